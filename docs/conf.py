"""Sphinx configuration of fusedce's documentation: ``make docs`` builds it into ``build/docs`` with
warnings as errors. The API reference (``api.rst``) is generated from the docstrings by autodoc, from
each module's ``__all__``, so a name exported from ``fusedce/__init__.py`` appears without a doc edit.
The Markdown pages (the contract, the cases, the architecture) are read by MyST."""
import re

import fusedce

project = "fusedce"
release = version = fusedce.__version__
copyright = "the fusedce authors; Apache-2.0"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

autodoc_member_order = "bysource"          # __all__'s order for modules that define it
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3                   # links to "#section" anchors in the Markdown pages
suppress_warnings = ["myst.xref_missing"]  # the pages' links to source files outside docs/

html_theme = "alabaster"
html_theme_options = {"description": "fused cross-entropy kernels for LLM training", "fixed_sidebar": True}


_GOOGLE_ENTRY = re.compile(r"^\s*`*[A-Za-z_][\w.]*`*\s*:\s")


def _prose_raises(app, what, name, obj, options, lines):
    """Many ``Raises:`` sections here are prose (several errors per sentence), not Google's "Type: why"
    entries, which napoleon would misread; before napoleon runs, such a section becomes a rubric and a
    paragraph. Google-style sections are left to napoleon."""
    for i, line in enumerate(lines):
        if line.strip() != "Raises:":
            continue
        body = next((ln for ln in lines[i + 1:] if ln.strip()), "")
        if _GOOGLE_ENTRY.match(body):
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        block = [ln.strip() for ln in lines[i + 1:j]]
        lines[i:j] = [" " * indent + ".. rubric:: Raises", ""] + [" " * indent + ln for ln in block] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _prose_raises, priority=400)   # napoleon's is 500
