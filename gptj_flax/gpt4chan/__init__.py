"""GPT-4chan's data preparation: ndjson dumps of 4chan threads → training text and TFRecords.

``thread_dumps`` streams dumps through worker processes into GPT-4chan's text format and/or the data
package's standard TFRecords (:func:`prepare_threads`); ``post_html`` turns a post's HTML into text.
Built on :mod:`gptj_flax.data`, which does not import it.
"""

from gptj_flax.gpt4chan.post_html import html_to_text
from gptj_flax.gpt4chan.thread_dumps import ThreadsResult, prepare_threads

__all__ = ["ThreadsResult", "html_to_text", "prepare_threads"]
