"""A 4chan post's HTML body (``com``) → plain text, parsed by :class:`html.parser.HTMLParser`, never regexes:

* text content is kept verbatim — entities decoded (``&gt;`` → ``>``, ``&#039;`` → ``'``), no
  whitespace collapsing (the original did none) — and tags are dropped, so a quote link
  ``<a class="quotelink">&gt;&gt;123</a>`` gives ``>>123`` and ``<span class="quote">&gt;x</span>``
  gives ``>x``; comments and ``<wbr>`` (a word-break hint) give nothing;
* ``<br>`` (also ``<br/>`` and the stray ``</br>`` browsers read as ``<br>``) gives ``\\n``;
* a block element (``p``, ``div``, ``pre``, ``li``, ``blockquote``, ``h1``…) ends with ``\\n`` and starts
  on a new line (a ``\\n`` only if the text so far does not already end with one); ``<hr>`` gives ``\\n``;
* finally the post's text is stripped of leading and trailing whitespace (``str.strip``), as the
  original did: trailing ``<br>``s and block ends never leave blank lines, so the only newline after
  a post is the one joining it to the next.

On 4chan's markup (``<br>``, ``<wbr>``, ``<a>``, ``<span>``, ``<s>``, entities) this gives what the
original (BeautifulSoup + lxml) gave; it differs only around block elements, where the original put
the newline before a ``<p>`` and none after it or around a ``<div>``.
"""

from __future__ import annotations

from html.parser import HTMLParser

# Elements a browser lays out as blocks: their text sits on lines of its own.
BLOCK_TAGS = frozenset(
    "address article aside blockquote dd details dialog div dl dt fieldset figcaption figure footer form "
    "h1 h2 h3 h4 h5 h6 header li main nav ol p pre section summary table tbody thead tfoot tr ul".split()
)
LINE_BREAK_TAGS = frozenset({"br", "hr"})


class _TextExtractor(HTMLParser):
    """Collects a comment's text content with line breaks where ``<br>`` and block elements put them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)  # entities arrive decoded in handle_data
        self.parts: list[str] = []

    def _break_line(self) -> None:
        if self.parts and not self.parts[-1].endswith("\n"):
            self.parts.append("\n")

    def handle_starttag(self, tag, attrs):
        if tag in LINE_BREAK_TAGS:
            self.parts.append("\n")
        elif tag in BLOCK_TAGS:
            self._break_line()

    def handle_startendtag(self, tag, attrs):
        # <br/> is one break; the default would also call handle_endtag and count it twice.
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        if tag == "br" or tag in BLOCK_TAGS:  # browsers read a stray </br> as <br>
            self.parts.append("\n")

    def handle_data(self, data):
        self.parts.append(data)


def html_to_text(html: str) -> str:
    """A post's HTML body (4chan's ``com``) as plain text; see the module docstring for the rules."""
    if "<" not in html and "&" not in html:
        return html.strip()  # most lines of most posts: nothing to parse
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts).strip()
