"""Secrets in task data: the values of the keys ``[task] secret_keys`` names are hidden
wherever taskrunner shows task data, results or periodic tasks' data to an operator — the
dashboard, the CLI's output, log lines. A key is secret when its name contains one of those
words, in any case (``db_password``, ``X-Api-Token``), at any depth of the JSON. Handlers
and the Python API get the data as it was given: only what is shown is masked.
"""
import re

MASK = "********"


def is_secret(key, words):
    lowered = key.lower()
    return any(word in lowered for word in words)


def masked(value, words):
    """The decoded JSON `value` with the value of each secret key replaced by MASK."""
    if not words:
        return value
    if isinstance(value, dict):
        return {key: MASK if isinstance(key, str) and is_secret(key, words)
                else masked(item, words) for key, item in value.items()}
    if isinstance(value, list):
        return [masked(item, words) for item in value]
    return value


def text_masker(words):
    """A function masking, in a line of text (a log line quoting JSON, a repr of a dict), the
    value after each quoted secret key: ``"password": "x"``, ``'token': 'y'``; None when
    no key is secret."""
    if not words:
        return None
    pattern = re.compile(
        r"""(["'])([^"'\n]*?(?:%s)[^"'\n]*)\1(\s*:\s*)"""
        r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s,}\]]+)"""
        % "|".join(re.escape(word.lower()) for word in words), re.IGNORECASE)

    def mask(text):
        return pattern.sub(lambda m: "%s%s%s%s%s" % (m.group(1), m.group(2), m.group(1),
                                                     m.group(3), '"%s"' % MASK), text)
    return mask
