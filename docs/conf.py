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


def _online(host: str = "docs.pyro.ai") -> bool:
    import socket

    try:
        socket.setdefaulttimeout(2)
        socket.gethostbyname(host)
        return True
    except OSError:
        return False


# Links to Pyro and PyTorch need their inventories; on a machine without a
# network (CI here) they cannot be fetched, and -W would turn that into a
# failure, so the references then stay plain text.
intersphinx_mapping = (
    {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "pyro": ("https://docs.pyro.ai/en/stable", None),
    }
    if _online()
    else {}
)
html_theme = "alabaster"
exclude_patterns = ["_build"]
