"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html`` (``pip install -e '.[docs]'``).

The pages are Markdown (MyST); the API reference is built from the docstrings (Google style).
Math is converted to MathML while the site is built (``_ext/offline_math.py``): pages show it
with no script and nothing fetched, offline too. ``tests/test_docs.py`` builds the site
warnings-as-errors, a formula that cannot be converted included.
"""

from __future__ import annotations

import os
import sys

import foldax

HERE = os.path.abspath(os.path.dirname(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "_ext"))

project = "foldax"
author = "the foldax authors"
copyright = "2026 The foldax authors"
release = version = foldax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "offline_math",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["dollarmath", "deflist"]
myst_heading_anchors = 3
myst_update_mathjax = False  # no MathJax to configure: math is MathML (offline_math)

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the jaxtyping annotations are long; the docstrings give shapes
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Numerics", "notes_style"), ("Raises", "params_style")]
napoleon_use_rtype = False
napoleon_attr_annotations = False

html_theme = "furo"
html_title = f"foldax {release}"
html_static_path = ["_static"]
html_css_files = ["offline_math.css"]
# TeX becomes MathML at build time (offline_math): no MathJax, no CDN, no network.
html_math_renderer = "mathml"
nitpicky = False
suppress_warnings: list[str] = []
