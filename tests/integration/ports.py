"""Free ports for the integration scripts: refit's own chooser (python/refit/_ports.py), loaded
by path because these scripts drive the CLI and run without the built Python extension.

It chooses outside the kernel's ephemeral range, so a port probed here cannot be taken by another
test's outgoing connection before the process under test binds it (ctest runs tests in parallel).
"""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "refit",
                     "_ports.py")
_spec = importlib.util.spec_from_file_location("refit_ports", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

free_port = _module.free_port
free_ports = _module.free_ports
free_port_block = _module.free_port_block
