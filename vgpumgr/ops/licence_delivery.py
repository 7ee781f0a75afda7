"""Delivering NVIDIA's client configuration token to each VM's guest (docs/sources.md §23).

Per VM a mode, chosen for the VM (`vm create --licence-delivery`, `license delivery VM MODE`), else for the
pool its seat comes from (`license delivery --pool P MODE`), else `VGPUMGR_LICENCE_DELIVERY` (default fwcfg):

* `fwcfg` (Linux guests): the domain XML names a per-VM copy of the token as a QEMU fw_cfg item
  (`<sysinfo type='fwcfg'><entry name='opt/dev.vgpumgr/nls/ft<N>/client_configuration_token' file=.../>`);
  the guest helper (vgpumgr/guest/) copies it into /etc/nvidia/ClientConfigToken/ at boot. The copy is
  written by `vm create`, refreshed by the libvirt `prepare` hook and Proxmox's pre-start, and removed with
  the VM. N is gridd.conf's FeatureType: 1 for a vGPU of any series, 2 (vWS) or 4 (vCS) for passthrough.
* `agent` (any guest with the QEMU guest agent, Windows included): `license deliver VM` writes the token into
  the guest's token directory through the agent and restarts the licensing service.
* `none`: vgpumgr does not deliver (a golden image or cloud-init does).

What is recorded (table licence_deliveries): the mode, how and when the token was last delivered, its
fingerprint and server, when the VM last started and when its guest first reported licensed after that.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from vgpumgr import ids
from vgpumgr.db.models import LicenceDelivery, LicenceLease, LicencePool, Vm
from vgpumgr.errors import InvalidInput, NotFound, VgpuError
from vgpumgr.licensing import seats as licensing
from vgpumgr.licensing import token as licence_token
from vgpumgr.ops.context import FAILED, OK, WARNING, Context

MODES = ("fwcfg", "agent", "none")
MODE_ENV = "VGPUMGR_LICENCE_DELIVERY"
FWCFG_PREFIX = "opt/dev.vgpumgr/nls/"
TOKEN_FILE = "client_configuration_token"
TOKEN_SET = "licence.token.set"
TOKEN_REMOVE = "licence.token.remove"
DELIVER = "licence.token.deliver"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidInput(f"licence delivery '{mode}' is unknown",
                           hint="use fwcfg (Linux guests, at boot), agent (QEMU guest agent, any OS) or none")
    return mode


def default_mode() -> str:
    raw = os.environ.get(MODE_ENV) or "fwcfg"
    if raw not in MODES:
        raise InvalidInput(f"{MODE_ENV}={raw!r} is not a delivery mode", hint="use fwcfg, agent or none")
    return raw


def feature_type(allocs: list[dict[str, Any]]) -> int | None:
    """gridd.conf's FeatureType for a VM's devices (None when no NVIDIA licence applies): 1 for a vGPU of any
    series (the driver picks the edition from the vGPU type), 4 for a passthrough GPU under a vCS seat, else 2."""
    series = [a.get("series") for a in allocs if a.get("series")]
    vgpu = [x for x in series if x != licensing.PASSTHROUGH]
    if vgpu:
        return 1
    if series:
        return 4 if any(a.get("licence") == "vCS" for a in allocs) else 2
    return None


def fwcfg_name(ft: int) -> str:
    return f"{FWCFG_PREFIX}ft{ft}/{TOKEN_FILE}"


def token_file_name(now: datetime | None = None) -> str:
    """NVIDIA's naming: client_configuration_token_<timestamp>.tok (the licensing portal's download name)."""
    return f"client_configuration_token_{(now or datetime.now(UTC)).strftime('%m-%d-%Y-%H-%M-%S')}.tok"


# -- records -------------------------------------------------------------------------------------------
def _row(s: Session, host_id: int, vm: str, create: bool = True) -> LicenceDelivery | None:
    row = s.scalar(select(LicenceDelivery).where(LicenceDelivery.host_id == host_id, LicenceDelivery.vm == vm))
    if row is None and create:
        row = LicenceDelivery(host_id=host_id, vm=vm)
        s.add(row)
        s.flush()
    return row


def _pools_of(s: Session, host_id: int, vm: str) -> list[LicencePool]:
    vm_id = s.scalar(select(Vm.id).where(Vm.host_id == host_id, Vm.name == vm))
    if vm_id is None:
        return []
    leases = s.scalars(select(LicenceLease).where(LicenceLease.vm_id == vm_id, LicenceLease.released_at.is_(None)))
    return list({lease.pool.id: lease.pool for lease in leases}.values())


def mode_of(svc: Context, s: Session, vm: str) -> tuple[str, str]:
    """(mode, where it was chosen: "vm", "pool P" or "default") for a VM."""
    h = svc.host_id(s)
    row = _row(s, h, vm, create=False)
    if row is not None and row.mode:
        return row.mode, "vm"
    for pool in _pools_of(s, h, vm):
        if pool.delivery:
            return pool.delivery, f"pool {pool.name}"
    return default_mode(), "default"


def token_for(svc: Context, s: Session, vm: str) -> tuple[bytes, licence_token.TokenInfo] | None:
    pools = [p.name for p in _pools_of(s, svc.host_id(s), vm)]
    return licence_token.for_vm(svc.cfg.state_dir, pools)


def set_vm_mode(svc: Context, vm: str, mode: str | None, *, actor: str | None = None,
                vm_uuid: str | None = None) -> dict[str, Any]:
    """Choose `vm`'s delivery (None: back to its pool's or the default). A defined VM's XML gets (or loses) the
    fw_cfg item for its next start."""
    vm = ids.vm_name(vm)
    if mode is not None:
        check_mode(mode)
    with svc.tx() as s:
        row = _row(s, svc.host_id(s), vm)
        row.mode = mode
        if vm_uuid:
            row.vm_uuid = ids.mdev_uuid(vm_uuid)
        effective, source = mode_of(svc, s, vm)
        svc.event(s, "licence.delivery.set", actor=actor, vm=vm, detail={"mode": mode, "effective": effective})
    virt = svc.virt()
    if virt.exists(vm):
        refresh_domain(svc, vm, virt=virt)
    return {"vm": vm, "mode": effective, "chosen_by": source}


def set_pool_mode(svc: Context, pool: str, mode: str | None, *, actor: str | None = None) -> dict[str, Any]:
    if mode is not None:
        check_mode(mode)
    with svc.tx() as s:
        row = licensing.get_pool(s, pool)
        row.delivery = mode
        svc.event(s, "licence.delivery.set", actor=actor, detail={"pool": pool, "mode": mode})
    return {"pool": pool, "mode": mode}


# -- fw_cfg --------------------------------------------------------------------------------------------
def fwcfg_for(svc: Context, vm: str, vm_uuid: str, allocs: list[dict[str, Any]], *,
              started: bool = False) -> list[tuple[str, str]]:
    """The fw_cfg item for a VM being created (after its allocations took their seats), with its token copy
    written; [] when its mode is not fwcfg, no licence applies or no token is set (and its old copy goes)."""
    ft = feature_type(allocs)
    with svc.tx() as s:
        mode, _ = mode_of(svc, s, vm)
        found = token_for(svc, s, vm) if mode == "fwcfg" and ft else None
        row = _row(s, svc.host_id(s), vm)
        row.vm_uuid = ids.mdev_uuid(vm_uuid)
        if found is None:
            licence_token.remove_vm_copy(svc.cfg.state_dir, vm_uuid)
            return []
        data, tok = found
        path = licence_token.write_vm_copy(svc.cfg.state_dir, vm_uuid, data)
        _delivered(row, "fwcfg", tok, started)
    return [(fwcfg_name(ft), str(path))]


def _delivered(row: LicenceDelivery, method: str, tok: licence_token.TokenInfo | None, started: bool,
               error: str | None = None) -> None:
    now = datetime.now(UTC)
    if tok is not None:
        row.method, row.fingerprint, row.server = method, tok.fingerprint, tok.server
        if method == "agent" or started:
            row.delivered_at = now
    if started:
        row.started_at, row.first_licensed_at = now, None
        if method == "fwcfg" and tok is not None:
            row.delivered_at = now  # QEMU hands it to the guest at this start
    row.error = error


def ours(xml: str) -> list[tuple[str, str | None]]:
    from vgpumgr.virt.domain import fwcfg_entries

    return [(n, f) for n, f in fwcfg_entries(xml) if n.startswith(FWCFG_PREFIX)]


def refresh_domain(svc: Context, vm: str, *, virt: Any = None) -> bool:
    """Give a defined VM's persistent XML the fw_cfg item its mode asks for (or take it away); True when the
    XML changed. Takes effect at the VM's next start."""
    from vgpumgr.ops import allocate as alloc
    from vgpumgr.virt import domain as domxml

    virt = virt or svc.virt()
    xml = virt.xml(vm, inactive=True)
    uuid = domxml.parse_xml(xml).findtext("uuid")
    entries = fwcfg_for(svc, vm, uuid, alloc.allocations(svc, vm=vm, live=True)) if uuid else []
    new = domxml.with_fwcfg(xml, entries, FWCFG_PREFIX)
    if domxml.fwcfg_entries(new) == domxml.fwcfg_entries(xml):
        return False
    virt.define(new, replace=True)
    return True


def prepare_start(svc: Context, vm: str, xml: str) -> dict[str, Any] | None:
    """The libvirt `prepare` hook (and a start by vgpumgr): the file the domain's fw_cfg item names gets the
    current token (QEMU fails to start on a missing file, so without a token it gets an empty one, which the
    guest helper ignores). None when the domain carries no item of ours."""
    from vgpumgr.virt import domain as domxml

    items = ours(xml)
    if not items:
        with svc.tx() as s:
            row = _row(s, svc.host_id(s), vm, create=False)
            if row is not None:
                _delivered(row, row.method or "none", None, True)
        return None
    uuid = domxml.parse_xml(xml).findtext("uuid") or ""
    with svc.tx() as s:
        row = _row(s, svc.host_id(s), vm)
        row.vm_uuid = ids.mdev_uuid(uuid) if uuid else row.vm_uuid
        found = token_for(svc, s, vm)
        expected = licence_token.fwcfg_path(svc.cfg.state_dir, uuid) if uuid else None
        for _name, path in items:
            if path is None or expected is None or os.path.abspath(path) != str(expected):
                continue  # an item that names another file is not ours to write
            licence_token.write_vm_copy(svc.cfg.state_dir, uuid, found[0] if found else b"")
        _delivered(row, "fwcfg", found[1] if found else None, True,
                   None if found else "no licence token is set (`vgpumgr license token set FILE`)")
    return {"fwcfg": [n for n, _ in items], "fingerprint": found[1].fingerprint if found else None}


def proxmox_args(svc: Context, vm: str) -> str | None:
    """Proxmox's pre-start (VM `pve-<vmid>`): refresh the VM's token copy and return the `args:` option that
    gives it to the guest (Proxmox passes fw_cfg only through root's `args:`); None without fwcfg or a token."""
    from vgpumgr.ops import allocate as alloc

    ft = feature_type(alloc.allocations(svc, vm=vm, live=True)) or 1
    with svc.tx() as s:
        mode, _ = mode_of(svc, s, vm)
        found = token_for(svc, s, vm) if mode == "fwcfg" else None
        if found is None:
            return None
        row = _row(s, svc.host_id(s), vm)
        path = licence_token.write_vm_copy(svc.cfg.state_dir, vm, found[0])
        _delivered(row, "fwcfg", found[1], True)
    return f"-fw_cfg name={fwcfg_name(ft)},file={path}"


def forget_vm(svc: Context, vm: str, vm_uuid: str | None) -> None:
    """A deleted VM: its token copy and its delivery record go."""
    with svc.tx() as s:
        row = _row(s, svc.host_id(s), vm, create=False)
        uuid = vm_uuid or (row.vm_uuid if row is not None else None)
        if row is not None:
            s.delete(row)
    if uuid:
        licence_token.remove_vm_copy(svc.cfg.state_dir, uuid)


def refresh_copies(svc: Context) -> int:
    """After a token change: the per-VM copy of every VM still in fwcfg mode gets the token that VM now gets
    (empty without one); the copy of a VM that left fwcfg mode goes."""
    d = licence_token.fwcfg_dir(svc.cfg.state_dir)
    n = 0
    with svc.sessions() as s:
        h = svc.host_id(s)
        by_uuid = {r.vm_uuid: r.vm for r in s.scalars(select(LicenceDelivery).where(LicenceDelivery.host_id == h))}
        for path in sorted(d.glob("*.tok")) if d.is_dir() else []:
            key = path.name[:-len(".tok")]
            vm = by_uuid.get(key) or key
            if mode_of(svc, s, vm)[0] != "fwcfg":
                licence_token.remove_vm_copy(svc.cfg.state_dir, key)
                continue
            found = token_for(svc, s, vm)
            licence_token.write_vm_copy(svc.cfg.state_dir, key, found[0] if found else b"")
            n += 1
    return n


# -- the token -----------------------------------------------------------------------------------------
def set_token(svc: Context, data: bytes, *, pool: str | None = None, actor: str | None = None,
              force: bool = False) -> dict[str, Any]:
    """Store the token (for every VM, or for `pool`'s), audit it by fingerprint, refresh the VMs' fw_cfg copies
    and push it to the running agent VMs (neither when it is the token already set: no guest's licensing service
    restarts for nothing). The answer carries what may be shown, never the token."""
    scope = licence_token.scope_of(pool)
    if pool is not None:
        with svc.sessions() as s:
            licensing.get_pool(s, pool)
    unusual = licence_token.shape_problem(data)
    new, old = licence_token.store(svc.cfg.state_dir, licence_token.check_token(data, "the token", force=force), scope)
    detail = {"scope": scope, "fingerprint": new.fingerprint, "server": new.server,
              "expires": new.expires.isoformat() if new.expires else None,
              "replaced": old.fingerprint if old else None}
    if unusual:  # forced: said in the audit trail (what it is, never its bytes)
        detail["forced"] = f"not the shape of a client configuration token: {unusual}"
    with svc.tx() as s:
        svc.event(s, TOKEN_SET, WARNING if unusual else OK, actor=actor, detail=detail)
    if old is not None and old.fingerprint == new.fingerprint:  # the same token again: the VMs already have it
        return {**detail, "action": TOKEN_SET, "expired": new.expired(), "fw_cfg_copies": 0, "agent": []}
    return {**detail, "action": TOKEN_SET, "expired": new.expired(), "fw_cfg_copies": refresh_copies(svc),
            "agent": deliver_agent_vms(svc, actor=actor)}


def remove_token(svc: Context, *, pool: str | None = None, actor: str | None = None) -> dict[str, Any]:
    scope = licence_token.scope_of(pool)
    old = licence_token.remove(svc.cfg.state_dir, scope)
    detail = {"scope": scope, "fingerprint": old.fingerprint}
    with svc.tx() as s:
        svc.event(s, TOKEN_REMOVE, actor=actor, detail=detail)
    return {**detail, "action": TOKEN_REMOVE, "fw_cfg_copies": refresh_copies(svc), "agent": []}


def tokens(svc: Context) -> list[dict[str, Any]]:
    return [t.to_json() for t in licence_token.all_info(svc.cfg.state_dir)]


# -- the guest agent -----------------------------------------------------------------------------------
def deliver(svc: Context, vm: str, *, actor: str | None = None) -> dict[str, Any]:
    """Write the VM's token into its guest through the QEMU guest agent and restart the licensing service."""
    from vgpumgr.guest import agent as guest_agent

    vm = ids.vm_name(vm)
    virt = svc.virt()
    if not virt.exists(vm):
        raise NotFound(f"no VM {vm}", hint="`vgpumgr vm list` shows the VMs")
    with svc.sessions() as s:
        found = token_for(svc, s, vm)
    if found is None:
        raise NotFound("no licence token is set", hint="set one first: `vgpumgr license token set FILE`")
    data, tok = found
    try:
        res = guest_agent.push_token(virt, vm, data, token_file_name())
    except VgpuError as e:
        with svc.tx() as s:  # a VM vgpumgr keeps a record of notes the failure; a refusal adds no row
            row = _row(s, svc.host_id(s), vm, create=False)
            if row is not None:
                row.error = e.message
        svc.record_failure(DELIVER, e, actor=actor, vm=vm)
        raise
    with svc.tx() as s:
        row = _row(s, svc.host_id(s), vm)
        _delivered(row, "agent", tok, False)
        if row.started_at is None:
            row.started_at = row.delivered_at
        svc.event(s, DELIVER, actor=actor, vm=vm,
                  detail={"method": "agent", "fingerprint": tok.fingerprint, "os": res["os"], "path": res["path"],
                          "service": res["service"], "restarted": res["restarted"]})
    return {"vm": vm, "method": "agent", "fingerprint": tok.fingerprint, **res}


def deliver_agent_vms(svc: Context, *, actor: str | None = None) -> list[dict[str, Any]]:
    """After a token change: deliver to every running VM whose mode is `agent` (errors are reported, not raised)."""
    virt = svc.virt()
    running = {d["name"] for d in virt.list() if d.get("state") in ("running", "paused")}
    out = []
    with svc.sessions() as s:
        names = [r.vm for r in s.scalars(select(LicenceDelivery).where(LicenceDelivery.host_id == svc.host_id(s)))
                 if r.vm in running and mode_of(svc, s, r.vm)[0] == "agent"]
    for vm in names:
        try:
            out.append(deliver(svc, vm, actor=actor))
        except VgpuError as e:
            out.append({"vm": vm, "error": e.message, "outcome": FAILED})
    return out


# -- what the licence check and the web view read -------------------------------------------------------
def records(svc: Context) -> dict[str, dict[str, Any]]:
    with svc.sessions() as s:
        h = svc.host_id(s)
        out = {}
        for r in s.scalars(select(LicenceDelivery).where(LicenceDelivery.host_id == h).order_by(LicenceDelivery.vm)):
            mode, source = mode_of(svc, s, r.vm)
            out[r.vm] = {"vm": r.vm, "vm_uuid": r.vm_uuid, "mode": mode, "chosen_by": source, "method": r.method,
                         "fingerprint": r.fingerprint, "server": r.server, "delivered_at": _iso(r.delivered_at),
                         "started_at": _iso(r.started_at), "first_licensed_at": _iso(r.first_licensed_at),
                         "error": r.error}
    return out


def note_licensed(svc: Context, snap: dict[str, Any]) -> None:
    """The first licensed state a guest reports after its VM started (for the time-to-licensed metric)."""
    licensed = {row["vm"] for row in snap.get("vgpus", []) if row["licence"]["state"] == "licensed" and row["vm"]}
    if not licensed:
        return
    def pending(s: Session) -> list[LicenceDelivery]:
        return list(s.scalars(select(LicenceDelivery).where(
            LicenceDelivery.host_id == svc.host_id(s), LicenceDelivery.vm.in_(sorted(licensed)),
            LicenceDelivery.started_at.is_not(None), LicenceDelivery.first_licensed_at.is_(None))))

    with svc.sessions() as s:  # a read on each sample; a write only on the pass that first sees it
        if not pending(s):
            return
    with svc.tx() as s:
        for r in pending(s):
            r.first_licensed_at = datetime.fromtimestamp(snap["taken"], UTC)


def _iso(v: datetime | None) -> str | None:
    return v.isoformat() if v is not None else None
