"""The system service enclosing each attempt: interface and backends."""

from ficc.execution.host.service.cgroupfs import CgroupfsService
from ficc.execution.host.service.interface import (
    Controls,
    DeviceAccess,
    DeviceRule,
    ServiceHandle,
    ServiceLimits,
    ServiceSpec,
    SystemService,
)
from ficc.execution.host.service.systemd import SystemdService

__all__ = [
    "CgroupfsService",
    "Controls",
    "DeviceAccess",
    "DeviceRule",
    "ServiceHandle",
    "ServiceLimits",
    "ServiceSpec",
    "SystemService",
    "SystemdService",
]
