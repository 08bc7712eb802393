"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html`` (``pip install -e '.[docs]'``).

The pages are Markdown (MyST); the API reference is built from the docstrings (Google style,
``.. math::`` rendered by MathJax). ``tests/test_docs.py`` builds it warnings-as-errors.
"""

from __future__ import annotations

import os
import sys

import foldax

sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))

project = "foldax"
author = "the foldax authors"
copyright = "the foldax authors"
release = version = foldax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["dollarmath", "deflist"]
myst_heading_anchors = 3

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
html_static_path: list[str] = []
# MathJax is loaded from its CDN when the pages are read; the build needs no network.
nitpicky = False
suppress_warnings: list[str] = []
