"""What taskrunner shows never carries a secret.

The database URL's: its password, in the URL's userinfo, a query string or a DSN's
``key=value`` words, is masked wherever a URL is shown and in every error, log line and
report, and each secret a URL carries is masked wherever a text quotes it (a driver's
message) — `redact`, `redactor`, `mask_url`.

Secrets in task data: the values of the keys ``[task] secret_keys`` names are hidden
wherever taskrunner shows task data, results or periodic tasks' data to an operator — the
dashboard, the CLI's output, log lines. A key is secret when its name contains one of those
words, in any case (``db_password``, ``X-Api-Token``), at any depth of the JSON. Handlers
and the Python API get the data as it was given: only what is shown is masked.
"""
import re
from urllib.parse import unquote

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
    # A key runs from its quote to the next quote or line end, so it is found whole, and the
    # lookahead (atomic) tells whether a secret word is in it: time linear in the line. Before,
    # "(key with the word)(rest)" backtracked over every occurrence of a word in an unclosed
    # quote: 87 s for '"' + 'tokenx' * 50,000.
    pattern = re.compile(
        r"""(["'])(?=[^"'\n]*?(?:%s))([^"'\n]*)\1(\s*:\s*)"""
        r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s,}\]]+)"""
        % "|".join(re.escape(word.lower()) for word in words), re.IGNORECASE)

    def mask(text):
        return pattern.sub(lambda m: "%s%s%s%s%s" % (m.group(1), m.group(2), m.group(1),
                                                     m.group(3), '"%s"' % MASK), text)
    return mask


# -- the database URL's secrets --------------------------------------------------------------

# Keywords whose value is a secret, in a query string (?password=...) or a libpq DSN
# (host=... password=...). Keys are compared unquoted and case-insensitively.
URL_SECRET_KEYS = frozenset(("password", "passwd", "pwd", "pass", "sslpassword",
                             "sslkey_password"))
# A key starts after a separator (or at the start): the match a search finds is the same
# without the lookbehind, but each position inside a word then fails at once instead of
# scanning the rest of the word for an '=' (quadratic in a word's length; a log line's cost).
_KEY = re.compile(r"(?<![^\s&;?=/'\"])([^\s&;?=/'\"]+)(\s*=\s*)")
_QUOTED = re.compile(r"'(?:\\.|[^'\\])*'?|\"(?:\\.|[^\"\\])*\"?")
# A secret's unquoted value runs to the next "&key=" or the end: it may hold ' ', ';' or '&'
# (masking a DSN's later words too is better than showing a part of a password).
_NEXT_PARAMETER = re.compile(r"&[^\s&=/'\"]+\s*=")
_USERINFO = re.compile(r"^\s*([^:/?#@\s]*:)?//")


def _secret_values(url):
    """Every secret `url` carries, as written and decoded: a driver's message may quote
    either form."""
    found = set()
    masked = _mask_keywords(url)
    start, at = masked.find("//"), masked.rfind("@")
    if 0 <= start < at and ":" in masked[start + 2:at]:
        found.add(masked[start + 2:at].partition(":")[2])
    for key in _KEY.finditer(url):
        if unquote(key.group(1)).strip().lower() in URL_SECRET_KEYS:
            found.add(url[key.end():_value_end(url, key.end())].strip("'\""))
    found |= {unquote(value) for value in found}
    return {value for value in found if value}


def redact(text, url=None):
    """`text` with every password replaced by ***: a URL's userinfo password (from the first
    ':' after '//' to the last '@', so an unencoded '@' or '/' in it does not leak a part),
    ``password=`` in a query string and in a DSN of ``key=value`` words, whatever the scheme;
    with `url`, also each secret of `url` wherever `text` quotes it (a driver's message).
    The one function every error, log line and report goes through."""
    return _redact(text, _masked_secrets(url))


def redactor(url):
    """`redact` with `url` fixed, its secrets found once: for every line of a log."""
    secrets = _masked_secrets(url)
    return lambda text: _redact(text, secrets)


def _masked_secrets(url):
    """The secrets of `url` (none when it is not a string) to mask wherever a text quotes them, longest first.
    One or two characters are no secret, and masking them everywhere garbles the message."""
    if not isinstance(url, str):
        return ()
    return tuple(sorted((s for s in _secret_values(url) if len(s) > 2), key=len, reverse=True))


def _redact(text, secrets):
    if not isinstance(text, str):
        text = str(text)
    # Keywords first: a password in the query may hold an '@' that is not the userinfo's.
    result = _mask_keywords(text)
    if _USERINFO.match(result):
        start, at = result.find("//"), result.rfind("@")
        colon = result.find(":", start + 2)
        if 0 <= colon < at:
            result = result[:colon + 1] + "***" + result[at:]
    for secret in secrets:
        result = result.replace(secret, "***")
    return result


def _mask_keywords(text):
    if "=" not in text:         # no keyword, no value: most log lines
        return text
    out, pos = [], 0
    while True:
        key = _KEY.search(text, pos)
        if key is None:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:key.end()])
        pos = key.end()
        if unquote(key.group(1)).strip().lower() not in URL_SECRET_KEYS:
            continue   # scan on inside the value: "host= password=x" gives host "password=x"
        pos = _value_end(text, pos)
        out.append("***")


def _value_end(text, start):
    """Where the secret value that starts at `start` ends: a quoted one at its closing
    quote; an unquoted one before the next "&key=", or at the end."""
    quoted = _QUOTED.match(text, start)
    if quoted:
        return quoted.end()
    following = _NEXT_PARAMETER.search(text, start)
    return following.start() if following else len(text)


def mask_url(url):
    """The URL as it may be shown: `redact(url)`."""
    return redact(url)
