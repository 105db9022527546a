"""Code the verbs tests run in the SoftRoCE guest, and the host side that boots it.

A package under tests/: host tests and the guest files import it as verbs_guest.<module>
wherever tests/ is on sys.path (pytest puts it there; rig_session hands it to the guest's
scripts through PYTHONPATH). The guest sees this checkout at the same path (the rig shares the
host's root read-only), so nothing is copied: the guest imports these files where they lie.
"""
