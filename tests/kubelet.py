"""The environment kubelet gives a pod for the Services of its namespace.

Kubernetes' ``pkg/kubelet/envvars``: for each Service with a cluster IP (not a
headless one), ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT`` (its first port),
``<NAME>_SERVICE_PORT_<PORT NAME>`` for each named port, and the Docker-link
style ``<NAME>_PORT=<proto>://<ip>:<port>`` and, for each port,
``<NAME>_PORT_<port>_<PROTO>`` with ``_PROTO``, ``_PORT`` and ``_ADDR``; NAME is
the Service's name in upper case with ``-`` as ``_``. Unless the pod sets
``enableServiceLinks: false``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def services(folder: Path = KUBERNETES) -> list[dict[str, Any]]:
    """Every Service object in the YAML files of ``folder`` and below."""
    found = []
    for path in sorted(folder.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Service":
                found.append(doc)
    return found


def service_links(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The variables kubelet sets for these Services, with made-up cluster IPs."""
    env: dict[str, str] = {}
    for n, service in enumerate(objects):
        spec = service["spec"]
        if spec.get("clusterIP") == "None" or not spec.get("ports"):
            continue  # headless: no variables
        name = service["metadata"]["name"].upper().replace("-", "_")
        ip = f"10.96.0.{10 + n}"
        ports = spec["ports"]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        first = ports[0]
        env[f"{name}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
        for port in ports:
            proto = port.get("protocol", "TCP")
            if "name" in port:
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
            prefix = f"{name}_PORT_{port['port']}_{proto}"
            env[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{prefix}_PROTO"] = proto.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = ip
    return env
