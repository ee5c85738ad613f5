"""`disagg-emulator`: the operator against the embedded Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import click

# The seed deployment, from the source tree (the demo's default when no file is given).
SEED_EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "deepseek-v2-lite-1p2d.yaml"


@click.group()
def main() -> None:
    """The disagg-operator against an embedded Kubernetes API emulator (no cluster needed)."""


@main.command("demo")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                required=False)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the kubeconfig, etcd data and logs go (default: a temporary folder).")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for Ready.")
def demo_cmd(path: Path | None, workdir: Path | None, timeout: float) -> None:
    """Run the operator against the embedded API emulator (no cluster needed): apply PATH with
    kubectl, wait for Ready, and print what was created and the status."""
    try:
        from disagg_devtools.emulator.demo import run_demo
    except ImportError as err:
        raise click.ClickException(
            f"the emulator needs {err.name}: pip install 'disagg-devtools[emulator]' "
            "(make demo-operator sets up .venv with it)") from None
    if path is None:
        path = SEED_EXAMPLE
        if not path.exists():
            raise click.UsageError("give the path of a DisaggServing YAML file")
    with tempfile.TemporaryDirectory(prefix="disagg-demo-") as scratch:
        code = asyncio.run(run_demo(path, workdir or Path(scratch), timeout, click.echo))
    sys.exit(code)


