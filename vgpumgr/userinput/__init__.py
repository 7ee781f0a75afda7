"""What a user hands vgpumgr on the command line or over REST, read by one set of rules (issue 43): files read
(`files.read`), files written (`files.atomic_target`, `files.write`) and numbers parsed (`numbers`).

Its own small folder rather than under `cli/`: the rules are used below the command line too (`db backup` in
vgpumgr.db.admin, the scheduler's modprobe file in vgpumgr.ops, the licence token the service stores), and they
import nothing of vgpumgr but `errors`, so any layer may use them without an import cycle."""
