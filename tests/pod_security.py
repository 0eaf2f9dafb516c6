"""The Pod Security Standards' "baseline" and "restricted" profiles, as checks of a pod spec.

Written from the published list of controls (kubernetes.io, "Pod Security
Standards", the Baseline and Restricted tables; the admission controller's
checks in k8s.io/pod-security-admission/policy are the same list in Go): each
control names the fields it restricts and the values it allows. The
admission controller is part of the API server, so there is no running it
without a cluster; ``violations`` applies the same rules to the pod template
of a manifest, and returns one line per field that breaks one, naming the
control as the published table does.

The Windows-only control (``hostProcess``) and AppArmor's annotation are
checked too; the seccomp annotations are not (the API server has ignored them
since Kubernetes 1.27: ``seccompProfile`` is what counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Baseline "Capabilities": what a container may add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
# Baseline "SELinux": the types allowed; user and role must be unset.
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"})
# Restricted "Capabilities": all that may be added once ALL is dropped.
RESTRICTED_ADD = frozenset({"NET_BIND_SERVICE"})
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
_APPARMOR = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``spec.containers[NAME]``-style path, container) of every container of the pod."""
    for key in _CONTAINER_LISTS:
        for container in spec.get(key) or []:
            yield f"spec.{key}[{container.get('name')}]", container


def _baseline(metadata: dict[str, Any], spec: dict[str, Any]) -> Iterator[str]:
    pod = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"Host Namespaces: spec.{field} is true"
    if (pod.get("windowsOptions") or {}).get("hostProcess"):
        yield "HostProcess: spec.securityContext.windowsOptions.hostProcess is true"
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            yield f"HostPath Volumes: spec.volumes[{volume['name']}] is a hostPath"
    yield from _selinux("spec.securityContext", pod)
    yield from _seccomp_not_unconfined("spec.securityContext", pod)
    if (pod.get("appArmorProfile") or {}).get("type") == "Unconfined":
        yield "AppArmor: spec.securityContext.appArmorProfile is Unconfined"
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"Sysctls: spec.securityContext.sysctls sets {sysctl.get('name')}"
    for name, value in (metadata.get("annotations") or {}).items():
        if name.startswith(_APPARMOR) and value not in ("runtime/default", "") and not value.startswith("localhost/"):
            yield f"AppArmor: annotation {name} is {value}"
    for path, container in _containers(spec):
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            yield f"Privileged Containers: {path}.securityContext.privileged is true"
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            yield f"HostProcess: {path}.securityContext.windowsOptions.hostProcess is true"
        added = set((context.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            yield f"Capabilities: {path}.securityContext.capabilities.add has {sorted(added)}"
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                yield f"Host Ports: {path}.ports[{port.get('name')}].hostPort is {port['hostPort']}"
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            for handler in ("httpGet", "tcpSocket"):
                if ((container.get(probe) or {}).get(handler) or {}).get("host"):
                    yield f"Probe host: {path}.{probe}.{handler}.host is set"
        yield from _selinux(f"{path}.securityContext", context)
        yield from _seccomp_not_unconfined(f"{path}.securityContext", context)
        if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
            yield f"AppArmor: {path}.securityContext.appArmorProfile is Unconfined"
        if context.get("procMount", "Default") != "Default":
            yield f"/proc Mount Type: {path}.securityContext.procMount is {context['procMount']}"


def _selinux(path: str, context: dict[str, Any]) -> Iterator[str]:
    options = context.get("seLinuxOptions") or {}
    if options.get("type", "") not in SELINUX_TYPES:
        yield f"SELinux: {path}.seLinuxOptions.type is {options['type']}"
    for field in ("user", "role"):
        if options.get(field):
            yield f"SELinux: {path}.seLinuxOptions.{field} is set"


def _seccomp_not_unconfined(path: str, context: dict[str, Any]) -> Iterator[str]:
    if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield f"Seccomp: {path}.seccompProfile is Unconfined"


def _restricted(spec: dict[str, Any]) -> Iterator[str]:
    pod = spec.get("securityContext") or {}
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"Volume Types: spec.volumes[{volume['name']}] is {sorted(kinds - RESTRICTED_VOLUMES)}"
    pod_non_root = pod.get("runAsNonRoot") is True
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if pod.get("runAsUser") == 0:
        yield "Running as Non-root user: spec.securityContext.runAsUser is 0"
    for path, container in _containers(spec):
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            yield f"Privilege Escalation: {path}.securityContext.allowPrivilegeEscalation is not false"
        # runAsNonRoot: true on the pod, or on every container; false nowhere.
        if context.get("runAsNonRoot") is False or (not pod_non_root and context.get("runAsNonRoot") is not True):
            yield f"Running as Non-root: {path} may run as root (runAsNonRoot not true here or on the pod)"
        if context.get("runAsUser") == 0:
            yield f"Running as Non-root user: {path}.securityContext.runAsUser is 0"
        # seccomp: RuntimeDefault or Localhost on the pod, or on every container.
        container_seccomp = (context.get("seccompProfile") or {}).get("type")
        if not pod_seccomp and container_seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"Seccomp: {path} has no RuntimeDefault or Localhost seccompProfile, nor has the pod"
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"Capabilities: {path}.securityContext.capabilities.drop does not include ALL"
        added = set(capabilities.get("add") or []) - RESTRICTED_ADD
        if added:
            yield f"Capabilities: {path}.securityContext.capabilities.add has {sorted(added)}"


def violations(template: dict[str, Any], profile: str = "restricted") -> list[str]:
    """What in a pod (or a workload's pod template: ``metadata`` and ``spec``) breaks
    ``profile``, "baseline" or "restricted" (which includes baseline); empty if nothing."""
    if profile not in ("baseline", "restricted"):
        raise ValueError(f"profile must be 'baseline' or 'restricted', got {profile!r}")
    metadata, spec = template.get("metadata") or {}, template["spec"]
    found = list(_baseline(metadata, spec))
    if profile == "restricted":
        found += _restricted(spec)
    return found
