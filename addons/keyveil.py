"""Entry for `mitmdump -s addons/keyveil.py --set keyveil_home=DIR`.

Thin on purpose: everything lives in the keyveil package. Prefer
`keyveil start`, which embeds the same addon without hot reload.
"""

import os
import sys

# mitmproxy puts this folder first on sys.path, where this file would hide
# the keyveil package of the same name: look past it, and fall back to the
# checkout's src/ when the package is not installed.
_here = os.path.dirname(os.path.abspath(__file__))
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
sys.path.append(os.path.join(os.path.dirname(_here), "src"))
try:
    from keyveil.addon import Keyveil
finally:
    sys.path[:] = _saved

addons = [Keyveil()]
