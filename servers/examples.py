"""Real requests to `monim serve-model` and its answers, shown by the HTTP reference (OpenAPI's examples):
the serve guide's memory (docs/guides/serve.md: two days of the bundled stream at --max-docs 2 with the
default LM, then a third), each request sent with curl and its answer copied as the server wrote it.
tests/test_http_reference.py sends each request to a running server and checks the answer's status and
shape, and that each answer here is exactly its schema model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """A request (a POST's body, or None: a GET, a body too large to show, or a failure no request causes)
    and the server's answer."""

    summary: str
    method: str
    path: str
    status: int
    answer: dict
    request: dict | None = None


EXAMPLES = {
    "text": Example("A text row: Θ's perplexity and the LM's alone", "post", "/invocations", 200,
        {'predictions': [{'tokens': 26, 'ppl': 7.125239726144702, 'ppl_lm': 93.33527527950238}]},
        {'dataframe_records': [{'text': 'Ashton-Tate said it intends to file for an offering of about two mln '
                                        'shares within the next 30 days.'}]}),
    "prompt": Example("A prompt row: its continuation, λ a token, each sentence's sources", "post", "/invocations", 200,
        {'predictions': [{'prompt': 'Ashton-Tate said it intends to',
                          'text': '\nfile for an offering of about two',
                          'tokens': [198, 2153, 327, 354, 5506, 282, 563, 827],
                          'lams': [0.99, 0.99, 0.99, 0.99, 0.99, 0.02, 0.99, 0.99],
                          'sentences': [{'text': '\nfile for an offering of about two',
                                         'sources': [{'date': '1987-03-03',
                                                      'doc_id': '996',
                                                      'title': 'ASHTON-TATE <TATE> TO OFFER COMMON SHARES',
                                                      'weight': 6.928514335699801},
                                                     {'date': '1987-03-02',
                                                      'doc_id': '270',
                                                      'title': 'PHILIPPINES HEADS CONFIDENTLY INTO DEBT TALKS',
                                                      'weight': 3.615969545433059e-07},
                                                     {'date': '1987-03-02',
                                                      'doc_id': '269',
                                                      'title': 'STRONG EARTHQUAKE HITS NEW ZEALAND',
                                                      'weight': 2.31163830251738e-11}]}],
                          'stopped': 'max_new_tokens',
                          'sources': []}]},
        {'dataframe_records': [{'prompt': 'Ashton-Tate said it intends to'}], 'params': {'max_new_tokens': 8}}),
    "retrieve": Example('A prompt row with retrieve: the article put before it, in sources', "post", "/invocations", 200,
        {'predictions': [{'prompt': 'Ashton-Tate said it intends to',
                          'text': ' file for an offering of about\n2',
                          'tokens': [2301, 327, 354, 5506, 282, 563, 198, 34],
                          'lams': [0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02],
                          'sentences': [{'text': ' file for an offering of about\n2',
                                         'sources': [{'date': '1987-03-03',
                                                      'doc_id': '996',
                                                      'title': 'ASHTON-TATE <TATE> TO OFFER COMMON SHARES',
                                                      'weight': 0.03248824046127264},
                                                     {'date': '1987-03-02',
                                                      'doc_id': '270',
                                                      'title': 'PHILIPPINES HEADS CONFIDENTLY INTO DEBT TALKS',
                                                      'weight': 0.0003482604314075695},
                                                     {'date': '1987-03-02',
                                                      'doc_id': '269',
                                                      'title': 'STRONG EARTHQUAKE HITS NEW ZEALAND',
                                                      'weight': 6.645783635405801e-08}]}],
                          'stopped': 'max_new_tokens',
                          'sources': [{'date': '1987-03-03',
                                       'doc_id': '996',
                                       'title': 'ASHTON-TATE <TATE> TO OFFER COMMON SHARES'}]}]},
        {'dataframe_records': [{'prompt': 'Ashton-Tate said it intends to', 'retrieve': True}],
         'params': {'max_new_tokens': 8}}),
    "refused": Example('A row refused, named as the body wrote it', "post", "/invocations", 400,
        {'error_code': 'BAD_REQUEST',
         'message': "dataframe_records[0]: give exactly one of 'text' (to score) or 'prompt' (to continue); "
                    "unknown field 'txt'"},
        {'dataframe_records': [{'txt': 'Oil prices rose.'}]}),
    "too_large": Example('A body over max_body_bytes, refused before it is read whole', "post", "/invocations", 413,
        {'error_code': 'REQUEST_ENTITY_TOO_LARGE',
         'message': 'the body is larger than 7745536 bytes (max_body_bytes: room for 32 rows of 20000 characters)'}),
    "damaged": Example('A served file differs from its commit: nothing is answered', "post", "/invocations", 503,
        {'error_code': 'BUSY',
         'message': '/tmp/serve-guide/w/memories/monim-amt/shards/000000-1987-03-02-ce4d8ee5/values.npy: written '
                    'since it was verified, it differs from the commit of day 1987-03-02; Θ is not answered from a '
                    'damaged memory: forget the day (`monim forget --day 1987-03-02`) or restore the file (`monim '
                    'fsck` lists every damaged file)'},
        {'dataframe_records': [{'prompt': 'Ashton-Tate said it intends to'}], 'params': {'max_new_tokens': 8}}),
    "failed": Example("Θ failed: the exception's type and message (not met in these examples: no request is shown)",
                      "post", "/invocations", 500,
        {'error_code': 'INTERNAL_ERROR', 'message': "RuntimeError: the exception's message"}),
    "ping": Example('Ready', "get", "/ping", 200,
        {'status': 'ok', 'problem': None}),
    "ping_damaged": Example('A served file differs from its commit', "get", "/ping", 503,
        {'status': 'damaged',
         'problem': '/tmp/serve-guide/w/memories/monim-amt/shards/000000-1987-03-02-ce4d8ee5/values.npy: written '
                    'since it was verified, it differs from the commit of day 1987-03-02; Θ is not answered from a '
                    'damaged memory: forget the day (`monim forget --day 1987-03-02`) or restore the file (`monim '
                    'fsck` lists every damaged file)'}),
    "version": Example('What answers', "get", "/version", 200,
        {'model': 'monim-news-monim-amt',
         'version': '2',
         'as_of': '1987-03-03',
         'monim': '0.1.0',
         'lm': 'smollm2-135m'}),
    "health": Example("Following the champion, which moved to the third day's version", "get", "/health", 200,
        {'model': 'monim-news-monim-amt',
         'version': '3',
         'as_of': '1987-03-04',
         'memory': '/tmp/serve-guide/w/memories/monim-amt',
         'checksum': '2d2dd8b35c23548a',
         'status': 'ok',
         'problem': None,
         'served_since': '2026-11-29T11:04:15+00:00',
         'follows': 'champion',
         'checked_every_s': 10.0,
         'checked_at': '2026-11-29T11:04:15+00:00',
         'champion': {'model': 'monim-news-monim-amt',
                      'version': '3',
                      'as_of': '1987-03-04',
                      'memory': '/tmp/serve-guide/w/memories/monim-amt',
                      'checksum': '2d2dd8b35c23548a'},
         'error': None,
         'limits': {'max_rows': 32,
                    'max_chars': 20000,
                    'max_new_tokens': 256,
                    'seconds': 60.0,
                    'max_body_bytes': 7745536,
                    'max_depth': 32}}),
}
