"""The library version, in one place (the package, the CLI and the rendezvous check read it)."""
__version__ = "0.1.0"
