"""The configuration file a Publisher or a Receiver may start from."""

from . import _core

#: A refit configuration file (the YAML ``refit push`` and ``refit serve`` read):
#: ``Config.load(path)`` or ``Config.parse(text)``. Pass it as ``config=`` to a Publisher or a
#: Receiver; explicit keyword arguments override what it says.
Config = _core.Config
