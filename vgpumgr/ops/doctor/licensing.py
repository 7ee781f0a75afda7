"""Section "licensing": where licensing is on, a client configuration token present and not expired (read from
the state directory; no network call). The host lists and creates types without a licence; guests need it."""

from __future__ import annotations

import os

from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Section

TITLE = "licensing"


def token(s: Section, f: Facts) -> None:
    from vgpumgr.licensing import token as licence_token

    mode = os.environ.get("VGPUMGR_LICENCE_MODE", "warn")
    check = "client configuration token"
    try:
        tokens = licence_token.all_info(f.cfg.state_dir)
    except Exception as e:  # noqa: BLE001 - an unreadable token directory is the finding itself
        s.warn("licence.token", check, f"cannot read the tokens: {e}",
               hint=f"run as root (the tokens are 0600 under {f.cfg.state_dir})")
        return
    if mode == "off":
        s.pass_("licence.token", check, "licensing off (VGPUMGR_LICENCE_MODE=off)")
        return
    if not tokens:
        s.note("licence.token", check, "no token stored: guests license only if their image brings one",
               hint="`vgpumgr licence token set client_configuration_token_*.tok` (from your licence server)")
        return
    expired = [t for t in tokens if t.expired()]
    if expired:
        s.fail("licence.token", check, f"token {', '.join(t.scope for t in expired)} expired "
                                       f"{min(t.expires for t in expired if t.expires):%Y-%m-%d}: new guests will "
                                       "not license", hint="download a new token from the licence server and "
                                                           "`vgpumgr licence token set FILE`")
        return
    soon = min((t.expires for t in tokens if t.expires), default=None)
    s.pass_("licence.token", check, f"{len(tokens)} token(s)" + (f", first expiry {soon:%Y-%m-%d}" if soon else ""))


CHECKS = (token,)
