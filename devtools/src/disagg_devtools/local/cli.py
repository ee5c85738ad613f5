"""`disagg-local`: up, down, status, drain and demo."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import yaml
from disagg_operator.spec import DisaggServingSpec, InvalidSpecError, parse_spec

from disagg_devtools.local.commands import LocalPlanError
from disagg_devtools.local.metrics import scrape_total
from disagg_devtools.local.runner import (
    LocalDeployment,
    RunFolder,
    StartupError,
    dead_summary,
    drain_recorded,
    local_defaults,
    log_tail,
    process_reports,
    stop_recorded,
)
from disagg_devtools.tiny_models import MODEL_NAMES

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
DEMO_EXAMPLE = EXAMPLES / "tiny-mla-1p2d.yaml"
DEFAULT_RUN_ROOT = Path(".disagg-local")


def load(path: Path, model: str | None) -> tuple[str, DisaggServingSpec]:
    doc = yaml.safe_load(path.read_text()) or {}
    name = str((doc.get("metadata") or {}).get("name") or path.stem)
    spec_doc = dict(doc.get("spec") or {})
    if model:
        spec_doc["model"] = {**(spec_doc.get("model") or {}), "name": model}
    try:
        return name, parse_spec(spec_doc)
    except InvalidSpecError as err:
        raise click.ClickException(f"{path}: {err}") from None


SERVING_MODULES = ("vllm", "kvhelper", "mooncake")


def check_serving_python(python: str) -> None:
    """The processes need vLLM, kvhelper and Mooncake: say which Python to use, up front,
    instead of a traceback from the first process that starts."""
    probe = ("import importlib.util, sys; sys.stdout.write(' '.join(m for m in sys.argv[1:] "
             "if importlib.util.find_spec(m) is None))")
    try:
        found = subprocess.run([python, "-c", probe, *SERVING_MODULES], capture_output=True,
                               text=True, timeout=60)
    except OSError as err:
        raise click.ClickException(f"--python {python}: {err}") from None
    missing = found.stdout.split() if found.returncode == 0 else list(SERVING_MODULES)
    if missing:
        raise click.ClickException(
            f"{python} lacks {', '.join(missing)}: local deployments run in the serving "
            "environment; use .venv-serving/bin/disagg-local (make run sets it up), or "
            "--python with a Python that has vLLM, kvhelper and Mooncake")


def with_tiny_model(spec: DisaggServingSpec, folder: RunFolder, python: str
                    ) -> DisaggServingSpec:
    """`spec.model.name: tiny-mla` or `tiny-gqa` (or `tiny-mla-compute`, `tiny-gqa-compute`;
    and no such folder here) means the project's random-weight model of that kind and size,
    generated into the run folder: no model hub needed."""
    found = MODEL_NAMES.get(spec.model.name)
    if found is None or Path(spec.model.name).exists():
        return spec
    kind, size = found
    model_dir = folder.root / f"{spec.model.name}-model"
    if not (model_dir / "config.json").exists():
        click.echo(f"generating the {size} {kind.upper()} model in {model_dir}")
        subprocess.run([python, "-m", "disagg_devtools.tiny_models", kind, str(model_dir),
                        "--size", size], check=True, stdout=subprocess.DEVNULL)
    model = spec.model.model_copy(update={
        "name": str(model_dir.resolve()),
        "served_model_name": spec.model.served_model_name or spec.model.name})
    return spec.model_copy(update={"model": model})


@click.group("disagg-local")
def local() -> None:
    """Run a DisaggServing on this machine (etcd, Mooncake master, vLLM servers, proxy)."""


@local.command("up")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Logs, config and state (default: .disagg-local/NAME).")
@click.option("--model", default=None, help="Serve this model (id or path) instead of the "
              "spec's spec.model.name.")
@click.option("--python", "python", default=sys.executable, show_default=True,
              help="The Python that has vLLM and kvhelper.")
@click.option("--proxy-port", type=int, default=None,
              help="Proxy port (default: spec.proxy.service.port).")
@click.option("--timeout", default=600.0, show_default=True,
              help="Seconds for all processes to become ready.")
def up_cmd(path: Path, run_dir: Path | None, model: str | None, python: str,
           proxy_port: int | None, timeout: float) -> None:
    """Start everything PATH describes and print the proxy's URL."""
    name, spec = load(path, model)
    check_serving_python(python)
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / name)
    spec = with_tiny_model(spec, folder, python)
    url = _up(name, spec, folder, python, proxy_port, timeout)
    click.echo(f"{name} is serving at {url} (logs in {folder.logs}); stop it with: "
               f"disagg-local down --run-dir {folder.root}")


def _up(name: str, spec: DisaggServingSpec, folder: RunFolder, python: str,
        proxy_port: int | None, timeout: float) -> str:
    deployment = LocalDeployment(name, spec, folder, python=python, proxy_port=proxy_port,
                                 echo=click.echo)
    try:
        return asyncio.run(deployment.up(timeout))
    except (StartupError, LocalPlanError) as err:
        raise click.ClickException(str(err)) from None


@local.command("rollout")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="default: .disagg-local/NAME")
@click.option("--model", default=None, help="As for `up`.")
@click.option("--python", "python", default=sys.executable, show_default=True)
@click.option("--timeout", default=600.0, show_default=True,
              help="Seconds for the new instances to become ready.")
def rollout_cmd(path: Path, run_dir: Path | None, model: str | None, python: str,
                timeout: float) -> None:
    """Move a running deployment's prefill and decode instances to the spec in PATH without
    failing a request, as the operator does: new instances start beside the old, and the old
    are drained once new prefill and decode instances can pair."""
    name, spec = load(path, model)
    check_serving_python(python)
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / name)
    spec = with_tiny_model(spec, folder, python)
    deployment = LocalDeployment(name, spec, folder, python=python, echo=click.echo)
    try:
        drained = asyncio.run(deployment.rollout(spec, timeout))
    except (StartupError, LocalPlanError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(f"{name} rolled out; drained {', '.join(drained) or 'nothing'}")


@local.command("down")
@click.argument("name", required=False)
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def down_cmd(name: str | None, run_dir: Path | None) -> None:
    """Stop everything `local up` started (by NAME, or its --run-dir)."""
    if run_dir is None and name is None:
        raise click.UsageError("give the DisaggServing's NAME or --run-dir")
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / str(name))
    if dead := dead_summary(process_reports(folder)):
        click.echo(f"already gone: {dead} (logs in {folder.logs})")
    stopped = stop_recorded(folder, click.echo)
    click.echo(f"stopped {stopped} processes" if stopped else "nothing was running")


@local.command("status")
@click.argument("name", required=False)
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--log-lines", default=5, show_default=True,
              help="Lines of each exited process's log to show.")
def status_cmd(name: str | None, run_dir: Path | None, log_lines: int) -> None:
    """Each process `local up` started: ready, running or how it ended (with its log's end).
    Exits 1 when any has ended."""
    if run_dir is None and name is None:
        raise click.UsageError("give the DisaggServing's NAME or --run-dir")
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / str(name))
    reports = process_reports(folder)
    if not reports:
        click.echo(f"nothing recorded in {folder.root}: not started, or stopped")
        return
    width = max(len(r.name) for r in reports)
    for report in reports:
        click.echo(f"{report.name:<{width}}  {report.describe()}")
        if not report.alive:
            click.echo(log_tail(folder.log(report.name), log_lines))
    if any(not r.alive for r in reports):
        sys.exit(1)


@local.command("drain")
@click.argument("name")
@click.argument("instances", nargs=-1, required=True)
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="default: .disagg-local/NAME")
def drain_cmd(name: str, instances: tuple[str, ...], run_dir: Path | None) -> None:
    """Take the vLLM INSTANCES of NAME (e.g. tiny-mla-decode-1) away gracefully, as a
    scale-down does in Kubernetes: withdrawn from the registry, in-flight requests finished,
    then stopped."""
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / name)
    env = {**os.environ, **local_defaults()}
    for instance in instances:
        try:
            drain_recorded(folder, instance, click.echo, env)
        except StartupError as err:
            raise click.ClickException(str(err)) from None


# A few blocks long: decode loads every full block before the prompt's last token.
DEMO_PROMPT = ("prefill computes the prompt and decode generates the answer while pages move "
               "between instances through the store; " * 3).strip()


@local.command("demo")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                default=DEMO_EXAMPLE, required=False)
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--python", "python", default=sys.executable, show_default=True)
@click.option("--prompt", default=DEMO_PROMPT, show_default=True)
def demo_cmd(path: Path, run_dir: Path | None, python: str, prompt: str) -> None:
    """Generate a tiny model, start PATH (default: 1 prefill + 2 decode) with it, send one
    completion through the proxy, print it, and stop everything."""
    name, spec = load(path, None)
    check_serving_python(python)
    folder = RunFolder(run_dir or DEFAULT_RUN_ROOT / name)
    spec = with_tiny_model(spec, folder, python)
    started = time.monotonic()
    url = _up(name, spec, folder, python, None, 600.0)
    click.echo(f"{name} ready at {url} after {time.monotonic() - started:.0f}s")
    try:
        body = {"model": spec.model.served_model_name or spec.model.name, "prompt": prompt,
                "max_tokens": 16, "temperature": 0, "logprobs": 1, "return_token_ids": True}
        answer = _post(f"{url}/v1/completions", body)
        choice = answer["choices"][0]
        click.echo(f"prompt:     {prompt}")
        click.echo(f"completion: {choice['text']!r}")
        click.echo(f"usage:      {answer.get('usage')}")
        blocks, nbytes = _kv_loaded(url, deadline=time.monotonic() + 30)
        click.echo(f"KV moved:   the decode instances loaded {blocks:.0f} blocks "
                   f"({nbytes:.0f} bytes) from the Mooncake store" if blocks else
                   "KV moved:   nothing (a prompt shorter than one block is recomputed)")
    finally:
        stop_recorded(folder, lambda _: None)
        click.echo("stopped")
    click.echo(_against_a_single_instance(spec, python, list(choice["prompt_token_ids"]),
                                          list(choice["token_ids"]),
                                          list(choice["logprobs"]["token_logprobs"])))


def _against_a_single_instance(spec: DisaggServingSpec, python: str, prompt: list[int],
                               tokens: list[int], logprobs: list[float]) -> str:
    """What one plain vLLM instance answers to the same prompt tokens, against this answer."""
    request = {"model": spec.model.name, "dtype": spec.model.dtype,
               "max_model_len": spec.model.max_model_len or 1024, "prompts": [prompt],
               "max_tokens": len(tokens)}
    found = subprocess.run([python, "-m", "disagg_devtools.local.single_instance",
                            json.dumps(request)], capture_output=True, text=True, timeout=600)
    if found.returncode != 0:
        return f"single instance: could not run ({found.stderr.strip()[-300:]})"
    single = json.loads(found.stdout.strip().splitlines()[-1])
    same = single["tokens"][0] == tokens
    gap = 0.0
    for a, b, x, y in zip(single["logprobs"][0], logprobs, single["tokens"][0], tokens,
                          strict=False):
        if x != y:
            break  # past here the two answer different prompts
        gap = max(gap, abs(a - b))
    noise = ("" if spec.model.dtype in ("float", "float32") else
             " (in 16-bit floats two ways of batching one prompt differ by up to about 5e-2;"
             " the float32 tests hold 1e-3)")
    return (f"single instance: {'the same' if same else 'NOT the same'} {len(tokens)} tokens "
            f"as one plain vLLM instance ({spec.model.dtype}); largest logprob gap {gap:.1e}"
            f"{noise}")


def _kv_loaded(proxy_url: str, deadline: float) -> tuple[float, float]:
    """Blocks and bytes the decode instances loaded from the store, from their /metrics (vLLM
    publishes connector counters at its stats interval, so this waits for them a while)."""
    with urllib.request.urlopen(f"{proxy_url}/instances", timeout=10) as response:
        decodes = [i["url"] for i in json.loads(response.read()) if i["role"] == "decode"]
    while True:
        blocks = scrape_total(decodes, "vllm:kvhelper_blocks_loaded_total")
        if blocks or time.monotonic() > deadline:
            return blocks, scrape_total(decodes, "vllm:kvhelper_bytes_loaded_total")
        time.sleep(1)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


if __name__ == "__main__":
    local()
