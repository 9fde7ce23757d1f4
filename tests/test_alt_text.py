"""Every figure of a lecture carries alt text from the figure itself (its titles and axis labels), recorded by the
kernel that drew it and shown by the website."""
from __future__ import annotations

import base64

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402

from par.course.batch import alt_text  # noqa: E402
from par.site import pages  # noqa: E402


def test_a_figure_is_described_by_its_titles_and_axis_labels():
    fig, (a, b) = plt.subplots(1, 2)
    fig.suptitle("ZeRO memory per rank")
    a.set_title("stage 1"), a.set_xlabel("N_d ranks"), a.set_ylabel("GB per rank")
    b.set_title("stage 3"), b.set_xlabel("N_d ranks")
    assert alt_text.describe(fig) == ("ZeRO memory per rank. Panel 1: stage 1 (x: N_d ranks, y: GB per rank). "
                                      "Panel 2: stage 3 (x: N_d ranks).")
    plt.close(fig)
    fig, ax = plt.subplots()
    assert alt_text.describe(fig) == "untitled."
    ax.set_axis_off()
    assert alt_text.describe(fig) == "A figure without a title or labelled axes."
    ax.set_title("x" * 1000)
    fig.suptitle("y" * 1000)
    assert len(alt_text.describe(fig)) == alt_text.MAX_CHARS
    plt.close(fig)


def test_the_inline_backend_sends_the_description_once_installed():
    from matplotlib_inline import backend_inline
    assert alt_text.install() and alt_text.install()                 # twice is once
    fig, ax = plt.subplots()
    ax.set_title("bubble vs m")
    assert backend_inline._fetch_figure_metadata(fig)["alt"] == "bubble vs m."
    assert backend_inline._fetch_figure_metadata.adds_alt_text
    plt.close(fig)


def test_the_site_shows_a_figure_with_its_recorded_alt_text():
    png = base64.b64encode(b"\x89PNG fake").decode()
    described = nbformat.v4.new_output("display_data", data={"image/png": png[:6] + "\n" + png[6:]},
                                       metadata={"alt": 'bytes "sent" per step (x: ranks).'})
    bare = nbformat.v4.new_output("display_data", data={"image/png": png})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("plot()", outputs=[described, bare])])
    shown = pages.static_notebook(nb).cells[0].outputs
    assert shown[0]["data"]["text/html"] == (f'<img src="data:image/png;base64,{png}" '
                                             'alt="bytes &quot;sent&quot; per step (x: ranks).">')
    assert 'alt="A figure (no description was recorded)."' in shown[1]["data"]["text/html"]
