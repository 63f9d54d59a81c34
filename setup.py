"""The native transfer engine, a C extension built at install (docs/transfer.md, "Native engine").

Plain C11 with pthreads and the Python C API; no CUDA toolkit: the driver's entry points are
resolved from libcuda.so.1 at run time. ``optional=True``: where no C compiler exists the install
still succeeds and the ``staged`` backend falls back to ``dma`` (``kvoffload doctor`` says so).
"""

from glob import glob

from setuptools import Extension, setup

NATIVE = "kvoffload/transfer/cuda/native/"

setup(
    ext_modules=[
        Extension(
            "kvoffload.transfer.cuda._engine",
            sources=sorted(glob(NATIVE + "*.c")),
            depends=sorted(glob(NATIVE + "*.h")),
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["dl", "pthread"],
            optional=True,
        )
    ]
)
