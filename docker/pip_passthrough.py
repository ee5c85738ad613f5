"""Print the podman arguments that give a build container this host's pip settings.

The package index here may need the host's CA bundle, a local wheel folder (find-links), local
indexes (file:// URLs) or a constraints file. Each setting is written into one pip.conf and
every local path it names is mounted read-only at the same path, so pip inside the build
resolves exactly as pip on the host does. Nothing is downloaded here.
"""

from __future__ import annotations

import configparser
import os
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

PATH_SETTINGS = {"cert", "client-cert", "find-links", "constraint", "requirement",
                 "index-url", "extra-index-url"}


def host_settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=True).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        if scope in {"global", ":env:", "install"} and value:
            settings[name] = value.strip().strip("'\"")
    return settings


def local_paths(name: str, value: str) -> list[Path]:
    if name not in PATH_SETTINGS:
        return []
    found = []
    for item in value.split():
        path = Path(urlparse(item).path) if item.startswith("file:") else Path(item)
        if name.endswith("index-url"):
            # A local index's pages link to files beside it (../../files/...).
            path = path.parent
        if path.is_absolute() and path.exists():
            found.append(path)
    return found


def main() -> None:
    conf_path = Path(sys.argv[1])
    settings = host_settings()
    parser = configparser.ConfigParser(interpolation=None)
    parser["global"] = settings
    with conf_path.open("w") as conf:
        parser.write(conf)
    # /etc/pip.conf is pip's site-wide file, read without any environment variable.
    args = ["--volume", f"{conf_path}:/etc/pip.conf:ro"]
    mounted: set[Path] = set()
    for name, value in settings.items():
        for path in local_paths(name, value):
            real = path.resolve()
            if real not in mounted:
                mounted.add(real)
                args += ["--volume", f"{real}:{real}:ro"]
                if real != path:
                    args += ["--volume", f"{real}:{path}:ro"]
    print(shlex.join(args))


if __name__ == "__main__":
    os.umask(0o022)
    main()
