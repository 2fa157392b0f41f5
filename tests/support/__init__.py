"""Helpers shared by the test modules, grouped by role (tests/ is on sys.path: `from support.toy import ...`)."""
