import subprocess
import sys


def test_import_does_not_pull_torch_or_cuda():
    code = (
        "import sys, kvoffload, kvoffload.store, kvoffload.offload, kvoffload.transfer, "
        "kvoffload.cli; kvoffload.cli.build_parser(); "
        "heavy = {'torch', 'triton', 'cuda', 'vllm'}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_store_package_never_imports_torch():
    code = "import sys, kvoffload.store; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
