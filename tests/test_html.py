"""The dashboard's HTML escapes by default: a value reaches a page as markup only when it
is marked `Markup` (H), so a page that forgets to escape shows the value as text."""
import pytest

pytest.importorskip("prometheus_client")

from taskrunner.web.html import H, e, page, table  # noqa: E402

HOSTILE = '<script>alert("x")</script>'
SHOWN = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"


def test_a_page_body_that_is_not_marked_is_text():
    html = page("Title <i>", "/", HOSTILE, notice=HOSTILE)
    assert "<script>" not in html and html.count(SHOWN) == 2
    assert "Title &lt;i&gt;" in html


def test_table_cells_that_are_not_marked_are_text():
    html = table(["<h>"], [[HOSTILE, H("<b>kept</b>")]], empty="none")
    assert "<script>" not in html and SHOWN in html and "<b>kept</b>" in html
    assert "<th>&lt;h&gt;</th>" in html


def test_what_is_put_into_markup_is_escaped_unless_it_is_markup():
    assert H("<p>%s %d %s</p>") % (HOSTILE, 3, H("<br>")) == "<p>%s 3 <br></p>" % SHOWN
    assert H("<p>%s</p>") % HOSTILE == "<p>%s</p>" % SHOWN
    assert H("<p>") + HOSTILE == "<p>" + SHOWN
    assert HOSTILE + H("<p>") == SHOWN + "<p>"
    assert H(", ").join([HOSTILE, H("<b>")]) == SHOWN + ", <b>"
    assert isinstance(H("<p>%s</p>") % "x", H) and isinstance(H("a") + "b", H)


def test_escaping_twice_is_escaping_once():
    assert e(e(HOSTILE)) == SHOWN
    assert H("<p>%s</p>") % e(HOSTILE) == "<p>%s</p>" % SHOWN
