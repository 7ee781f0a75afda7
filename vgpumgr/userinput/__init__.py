"""What a user hands vgpumgr on the command line or over REST, read by one set of rules (issue 43): files read
(`files.read`, `files.regular`), files written (`files.atomic_target`, `files.write`) and numbers parsed
(`numbers`).
Layer 0: may import errors only, so that every layer may use it (hostfs's root and config check the paths they
are given, db's backup writes by it, cli and api parse numbers by it); hence its own small folder, not cli/.
"""
