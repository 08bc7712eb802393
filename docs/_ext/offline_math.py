"""Sphinx extension: math rendered to MathML when the site is built, so pages need no script.

Every formula (``.. math::``, ``:math:``, MyST's ``$$ ... $$``) is converted from TeX to MathML
by the pure-Python ``latex2mathml`` while Sphinx writes the HTML; browsers render MathML
natively, so a page shows its math offline, and nothing is fetched when it is read. The TeX stays
in the page as the formula's annotation (what copy-and-paste and screen readers may use).

A formula the converter cannot translate (a command it does not know, unbalanced braces, or
output that is not well-formed MathML) is a build warning at the formula's source line, so that
``sphinx-build -W`` fails on it; the page then shows the TeX as text.

Use: add ``"offline_math"`` to ``extensions`` (its folder on ``sys.path``); it registers the
``mathml`` HTML math renderer, which Sphinx then picks (``html_math_renderer = "mathml"`` says so
explicitly).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import latex2mathml
import latex2mathml.converter
from docutils import nodes
from sphinx.locale import _
from sphinx.util import logging
from sphinx.util.math import get_node_equation_number

logger = logging.getLogger(__name__)

_NS = "http://www.w3.org/1998/Math/MathML"
_COMMAND = re.compile(r"\\[A-Za-z]+|\\.")
#: Large operators that take their limits under / over them in display math (not integrals).
_BIG = set("\u2211\u220f\u2210\u22c0\u22c1\u22c2\u22c3\u2a00\u2a01\u2a02\u2a04\u2a06")
#: After an operator name (log, exp), TeX's thin space, except before an opening fence.
_THIN = "0.1667em"
_OPEN = set("([{|\u2016\u27e8")
_SCRIPTS = {"msub", "msup", "msubsup", "munder", "mover", "munderover"}
#: Elements whose children are a row (any number of them): where a space may be inserted.
_ROWS = {"math", "mrow", "mstyle", "mtd", "msqrt", "mpadded", "mphantom", "menclose"}


def to_mathml(tex: str, *, display: bool) -> str:
    """One TeX formula as a ``<math>`` element, its TeX kept as an annotation.

    Args:
      tex: the formula's TeX, without delimiters (``\\frac{1}{n} \\sum_i v_i``).
      display: a block formula (``display="block"``) rather than one inside a line of text.

    Returns:
      The HTML of one ``<math>`` element.

    Raises:
      ValueError: the converter failed, left a TeX command untranslated, or wrote something
        that is not well-formed MathML; the message names the formula and what went wrong.
    """
    try:
        out = latex2mathml.converter.convert(tex, display="block" if display else "inline")
    except Exception as e:  # the converter's own errors (unbalanced braces, ...) have no message
        raise ValueError(_why(tex, f"latex2mathml raised {type(e).__name__} {e}".strip())) from e
    try:
        root = ET.fromstring(out)
    except ET.ParseError as e:
        raise ValueError(_why(tex, f"the converter wrote malformed MathML ({e})")) from None
    for element in root.iter():
        for text in (element.text, element.tail):
            if text and (command := _COMMAND.search(text)):
                raise ValueError(
                    _why(tex, f"the command {command.group(0)} is not known to latex2mathml")
                )
    for element in root.iter():  # plain names: the one namespace is declared on <math>
        element.tag = element.tag.rpartition("}")[2]
    _space_operator_names(root)
    _operators(root, display=display)
    _sized_fences(root)
    math = ET.Element("math", xmlns=_NS, display=root.get("display", "inline"))
    semantics = ET.SubElement(math, "semantics")
    ET.SubElement(semantics, "mrow").extend(root)
    ET.SubElement(semantics, "annotation", encoding="application/x-tex").text = tex
    return ET.tostring(math, encoding="unicode")


def _is_name(element) -> bool:
    """An operator name: ``\\log`` becomes ``<mi>log</mi>`` (``\\mathrm`` letters are one each)."""
    text = element.text or ""
    return element.tag == "mi" and len(text) > 1 and text.isalpha()


def _space_operator_names(root) -> None:
    """``\\log x``: a thin space after the name, as TeX sets it (MathML adds none after an
    ``<mi>``); none before an opening fence, ``\\log(x)``. A name under a script counts."""
    for parent in [e for e in root.iter() if e.tag in _ROWS]:
        children = list(parent)
        for i in reversed(range(len(children) - 1)):
            child, after = children[i], children[i + 1]
            base = child[0] if child.tag in ("msub", "msup") and len(child) else child
            if _is_name(base) and not (after.tag == "mo" and after.text in _OPEN):
                parent.insert(i + 1, ET.Element("mspace", width=_THIN))


def _operators(root, *, display: bool) -> None:
    """Operators spaced and placed as TeX sets them, where the converter writes otherwise:
    ``\\bigoplus`` and ``:`` are operators (``<mo>``: the browser enlarges a large one in
    display math and spaces a relation); a named operator (``\\max``) has no space before it
    beyond what precedes it, and a thin space after; in display math ``\\max_{i}`` and
    ``\\bigoplus_{j}`` take their limits under them (the converter writes a subscript)."""
    scripts = {"msub": "munder", "msubsup": "munderover"}
    for element in root.iter():
        if element.tag == "mi" and (element.text in _BIG or element.text == ":"):
            element.tag = "mo"
        if element.tag == "mo" and len(element.text or "") > 1 and element.text.isalpha():
            element.set("lspace", "0em")
            element.set("rspace", _THIN)
    for element in root.iter() if display else ():
        if element.tag in scripts and len(element) and element[0].tag == "mo":
            text = element[0].text or ""
            if text in _BIG or text.isalpha():
                element.tag = scripts[element.tag]


def _sized_fences(root) -> None:
    """``\\Big)^{1/2}``: the sized fence under a script is wrapped in a row, where browsers
    apply its size (as a script's bare base they set it at the text's size)."""
    for element in root.iter():
        if element.tag in _SCRIPTS and len(element) and element[0].get("minsize"):
            row = ET.Element("mrow")
            row.append(element[0])
            element[0] = row


def _why(tex: str, reason: str) -> str:
    return (
        f"cannot render the math {tex!r} as MathML: {reason} (latex2mathml "
        f"{latex2mathml.__version__}); rewrite it with what the converter supports (e.g. "
        f"\\mathrm{{name}} for an upright name, split rather than aligned for aligned lines)"
    )


def _render(translator, node, tex: str, *, display: bool) -> str:
    """``to_mathml``, or, where it fails, a warning at the node and the TeX shown as text."""
    try:
        return to_mathml(tex, display=display)
    except ValueError as e:
        logger.warning(str(e), location=node, type="math", subtype="mathml")
        return translator.encode(tex)


def visit_math(translator, node: nodes.math) -> None:
    """A formula inside a line of text (``:math:``, MyST's ``$ ... $``)."""
    translator.body.append(translator.starttag(node, "span", "", CLASS="math notranslate"))
    translator.body.append(_render(translator, node, node.astext(), display=False))
    translator.body.append("</span>")
    raise nodes.SkipNode


def visit_displaymath(translator, node: nodes.math_block) -> None:
    """A block formula (``.. math::``, MyST's ``$$``): each blank-line-separated part is one
    ``<math>``; a part with ``\\\\`` line breaks is set as a ``split`` environment."""
    translator.body.append(translator.starttag(node, "div", CLASS="math notranslate"))
    if node["number"]:
        number = get_node_equation_number(translator, node)
        translator.body.append(f'<span class="eqno">({number})')
        translator.add_permalink_ref(node, _("Link to this equation"))
        translator.body.append("</span>")
    for part in (p for p in node.astext().split("\n\n") if p.strip()):
        if "\\\\" in part and not node.get("nowrap", node.get("no-wrap", False)):
            part = f"\\begin{{split}}{part}\\end{{split}}"
        translator.body.append(_render(translator, node, part, display=True))
    translator.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("mathml", (visit_math, None), (visit_displaymath, None))
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
