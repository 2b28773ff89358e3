"""MkDocs hook: each page's ``<!-- kvcompile: NAME -->`` lines become the tables pytest_kvcompile.docs renders from
the code (options, markers, fixtures, contract, engines, zoo, ci, schema), so the reference is never hand-copied."""

from pytest_kvcompile import docs


def on_page_markdown(markdown, page, config, files):
    return docs.expand(markdown)
