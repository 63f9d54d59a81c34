"""The C extensions built at install: the native transfer core (docs/transfer.md, "Native
core") and the native block index (kvoffload/store/index.py).

Plain C11 with pthreads and the Python C API; no CUDA toolkit: the driver's entry points are
resolved from libcuda.so.1 at run time. ``optional=True``: where no C compiler exists the install
still succeeds, the ``staged`` backend falls back to ``dma``, and building a ``BlockIndex`` (every
Offloader does) raises ImportError saying how to get the extension (a wheel carries both;
``kvoffload doctor`` names what is missing).
"""

from glob import glob

from setuptools import Extension, setup

NATIVE = "kvoffload/transfer/cuda/native/"
INDEX = "kvoffload/store/native/"

setup(
    ext_modules=[
        Extension(
            "kvoffload.transfer.cuda._core",
            sources=sorted(glob(NATIVE + "*.c")),
            depends=sorted(glob(NATIVE + "*.h")),
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            libraries=["dl", "pthread"],
            optional=True,
        ),
        Extension(
            "kvoffload.store._index",
            sources=[
                INDEX + f
                for f in (
                    *("module.c", "index.c", "check.c", "batch.c", "keys.c", "table.c"),
                    *("lists.c", "policy.c", "lru.c", "arc.c", "inspect.c", "ids.c", "bind_ids.c"),
                    "runs.c",
                )
            ],
            depends=[INDEX + "ix.h", INDEX + "binding.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
