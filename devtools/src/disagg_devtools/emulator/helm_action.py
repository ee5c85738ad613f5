"""Run one helm action through helm-sdkpy (Python 3.12, in .venv-tools); print JSON.

    helm_action.py lint CHART
    helm_action.py install KUBECONFIG NAMESPACE RELEASE CHART [VALUES_JSON]
"""

import asyncio
import json
import sys

import helm_sdkpy as helm  # in .venv-tools only (Python 3.12)


async def main(argv: list[str]) -> None:
    action = argv[0]
    if action == "lint":
        result = await helm.Lint(helm.Configuration()).run(argv[1])
    elif action == "install":
        kubeconfig, namespace, release, chart = argv[1:5]
        values = json.loads(argv[5]) if len(argv) > 5 else None
        config = helm.Configuration(namespace=namespace, kubeconfig=kubeconfig)
        result = await helm.Install(config).run(release, chart, values=values, wait=True,
                                                timeout=60)
    else:
        raise SystemExit(f"unknown action {action}")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
