"""A post's HTML → text: line breaks, entities, quote links, block elements, stripping."""

import pytest

from gptj_flax.gpt4chan import html_to_text


@pytest.mark.parametrize(
    "html, text",
    [
        ("a<br>b<br/>c</br>d", "a\nb\nc\nd"),
        ("http://exa<wbr>mple.com", "http://example.com"),
        ('<a href="#p123" class="quotelink">&gt;&gt;123</a>', ">>123"),
        ('<span class="quote">&gt;be me</span><br>&gt;&gt; not a link', ">be me\n>> not a link"),
        ("&amp;amp; &lt;b&gt; &#039;&quot; &eacute;&#x263a;", "&amp; <b> '\" é☺"),
        ("  <br><br>text<br><br>  ", "text"),
        ("<p>one</p><p>two</p>", "one\ntwo"),
        ("x<pre>code<br>more</pre>y<hr>z", "x\ncode\nmore\ny\nz"),
        ("a <!-- hidden --> b", "a  b"),
        ("tabs\tand  spaces kept", "tabs\tand  spaces kept"),
        ("1 < 2 and a<3", "1 < 2 and a<3"),
        ("", ""),
    ],
)
def test_html_to_text(html, text):
    assert html_to_text(html) == text
