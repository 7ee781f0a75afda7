"""Errors a person can act on: what went wrong, and what to do about it.

Every error carries an HTTP-like status so the CLI (exit codes) and the REST API (problem+json)
map them the same way.
"""

from __future__ import annotations

import errno as _errno


class VgpuError(Exception):
    status = 500
    exit_code = 1
    kind = "error"

    def __init__(self, message: str, hint: str | None = None, **detail: object) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.detail = detail

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}: {self.hint}"

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"error": self.kind, "message": self.message}
        if self.hint:
            d["hint"] = self.hint
        d.update({k: v for k, v in self.detail.items() if v is not None})
        return d


class InvalidInput(VgpuError):
    status = 400
    exit_code = 2
    kind = "invalid-input"


class NotFound(VgpuError):
    status = 404
    exit_code = 3
    kind = "not-found"


class Conflict(VgpuError):
    """No capacity, no seat, already exists, device busy."""

    status = 409
    exit_code = 4
    kind = "conflict"


class Busy(Conflict):
    kind = "busy"


class NoCapacity(Conflict):
    kind = "no-capacity"


class NoSeat(Conflict):
    kind = "no-licence-seat"


class GuestNotReady(Conflict):
    """The VM's guest cannot answer yet (no QEMU guest agent connected, the guest still booting): the service is
    fine, the guest is not; a client retries later or fixes the guest (409, not 503)."""

    kind = "guest-not-ready"


class PermissionDenied(VgpuError):
    status = 403
    exit_code = 5
    kind = "permission-denied"


class Timeout(VgpuError):
    status = 504
    exit_code = 6
    kind = "timeout"


class KernelError(VgpuError):
    """A sysfs write the kernel refused, with the errno turned into advice."""

    status = 409
    exit_code = 7
    kind = "kernel-error"


class Unavailable(VgpuError):
    status = 503
    exit_code = 8
    kind = "unavailable"


class SchemaMismatch(VgpuError):
    """This vgpumgr and the database's schema cannot work together (rolling upgrades, vgpumgr.db.schema)."""

    status = 503
    exit_code = 11
    kind = "schema-mismatch"


class AuditBroken(VgpuError):
    """The audit chain, or a checkpoint of it, shows tampering or loss."""

    status = 409
    exit_code = 9
    kind = "audit-broken"


# errno -> (error class, what it usually means for this kind of write)
_ERRNO_ADVICE: dict[int, tuple[type[VgpuError], str]] = {
    _errno.EEXIST: (Conflict, "a device with this UUID already exists (UUIDs are global across parents); "
                    "pick another UUID or omit --uuid"),
    _errno.EINVAL: (InvalidInput, "the kernel rejected the value written"),
    _errno.ENOSPC: (NoCapacity, "no instances of this type are left on this parent; "
                    "remove a vGPU or choose another parent/type (`vgpumgr types` shows what is available)"),
    _errno.EUSERS: (NoCapacity, "the parent's instance limit is reached; remove a vGPU or choose another parent"),
    _errno.EBUSY: (Busy, "the device is in use; stop the VM that holds it, or write 0 first for SR-IOV counts"),
    _errno.EACCES: (PermissionDenied, "the file is not writable; run as root"),
    _errno.EPERM: (PermissionDenied, "the operation is not permitted in the device's current state"),
    _errno.ENODEV: (NotFound, "the device is gone or not configured"),
    _errno.ENOENT: (NotFound, "the device or attribute does not exist (already removed?)"),
    _errno.ERANGE: (InvalidInput, "the value is out of range (above sriov_totalvfs?)"),
    _errno.EIO: (KernelError, "the driver reported an I/O error; check `dmesg`"),
}


def error_class(kind: str) -> type[VgpuError]:
    """The error class of that kind (an error recorded as a dict raised again as what it was)."""
    todo: list[type[VgpuError]] = [VgpuError]
    while todo:
        c = todo.pop()
        if c.kind == kind:
            return c
        todo += c.__subclasses__()
    return VgpuError


def from_oserror(exc: OSError, action: str, hint: str | None = None) -> VgpuError:
    """Turn a failed sysfs write into an error a person can act on."""
    cls, advice = _ERRNO_ADVICE.get(exc.errno or 0, (KernelError, "check `dmesg` for the driver's message"))
    name = _errno.errorcode.get(exc.errno or 0, str(exc.errno))
    err = cls(f"{action} failed: {exc.strerror or exc} ({name})", hint=hint or advice, errno=name)
    return err
