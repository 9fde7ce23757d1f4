"""Alt text for every figure a notebook shows, from the figure itself: its title, each panel's title and axis labels.

`install()` (run when a notebook imports `par.course.batch.record`) makes the inline backend put that text in the
figure's output metadata (`{"image/png": {"alt": ...}}` in the saved notebook), where the website reads it
(`par.site.pages`). A reader of the site who cannot see the image reads what it shows and on which axes.
"""
from __future__ import annotations

MAX_CHARS = 400


def _text(artist) -> str:
    return " ".join(artist.get_text().split()) if artist is not None else ""


def describe(fig) -> str:
    """'<suptitle>. Panel 1: <title> (x: <xlabel>, y: <ylabel>). Panel 2: ...' from what the figure shows."""
    parts = []
    suptitle = _text(getattr(fig, "_suptitle", None))
    if suptitle:
        parts.append(suptitle + ".")
    axes = [ax for ax in fig.get_axes() if ax.get_visible() and ax.axison]
    for i, ax in enumerate(axes, 1):
        title = " ".join(t for t in (_text(ax.title), _text(ax._left_title), _text(ax._right_title)) if t)
        labels = ", ".join(f"{name}: {text}" for name, text in (("x", _text(ax.xaxis.label)),
                                                                  ("y", _text(ax.yaxis.label))) if text)
        what = (title or "untitled") + (f" ({labels})" if labels else "")
        parts.append(f"Panel {i}: {what}." if len(axes) > 1 else f"{what}.")
    text = " ".join(parts) or "A figure without a title or labelled axes."
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 1] + "…"


def install() -> bool:
    """Add the figure's description to what matplotlib's inline backend sends with each figure; False where that
    backend is not the one in use (a terminal, a script) or has no such hook."""
    try:
        from matplotlib_inline import backend_inline
    except ImportError:
        return False
    original = getattr(backend_inline, "_fetch_figure_metadata", None)
    if original is None or getattr(original, "adds_alt_text", False):
        return original is not None

    def with_alt_text(fig):
        metadata = original(fig) or {}
        return {**metadata, "alt": describe(fig)}

    with_alt_text.adds_alt_text = True
    backend_inline._fetch_figure_metadata = with_alt_text
    return True
