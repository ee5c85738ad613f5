"""The `disagg-operator` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import yaml

from disagg_operator.crd import render_crd_yaml
from disagg_operator.render import Owner, render
from disagg_operator.spec import InvalidSpecError, parse_spec

DEFAULT_SERVING_IMAGE = "disagg-operator/serving:0.1.0"


@click.group()
def main() -> None:
    """Run disaggregated vLLM serving on Kubernetes."""


@main.command()
def crd() -> None:
    """Print the DisaggServing CustomResourceDefinition."""
    click.echo(render_crd_yaml(), nl=False)


@main.command("render")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--namespace", default="default", show_default=True)
@click.option("--image", "default_image", default=DEFAULT_SERVING_IMAGE, show_default=True,
              help="Serving image for specs that do not set one.")
def render_cmd(path: Path, namespace: str, default_image: str) -> None:
    """Print the objects the operator would create for a DisaggServing YAML file."""
    doc = yaml.safe_load(path.read_text())
    meta = doc.get("metadata") or {}
    try:
        spec = parse_spec(doc.get("spec"))
    except InvalidSpecError as err:
        click.echo(f"error: {path}: {err}", err=True)
        sys.exit(2)
    owner = Owner(meta.get("name", "unnamed"), meta.get("namespace", namespace), "<uid>")
    click.echo(yaml.safe_dump_all(render(owner, spec, default_image), sort_keys=False), nl=False)


if __name__ == "__main__":
    main()
