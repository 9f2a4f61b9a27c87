import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "pyro-vinit"
author = "pyro-vinit developers"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
autodoc_member_order = "bysource"
autodoc_typehints = "none"


# Links into the Python, PyTorch and Pyro docs. Each project's inventory is read from a
# file shipped in _inventories/ (the build machines have no network; see
# _inventories/make_inventories.py for why and how to regenerate them), while the links
# point at the real documentation, so the build is the same online and offline.
_INVENTORIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_inventories")
intersphinx_mapping = {
    "python": ("https://docs.python.org/3/", os.path.join(_INVENTORIES, "python.inv")),
    "torch": ("https://pytorch.org/docs/stable/", os.path.join(_INVENTORIES, "torch.inv")),
    "pyro": ("https://docs.pyro.ai/en/stable/", os.path.join(_INVENTORIES, "pyro.inv")),
}
html_theme = "alabaster"
exclude_patterns = ["_build", "_inventories"]
