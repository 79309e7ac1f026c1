"""The documentation site's generated pages (``python -m ops.docs``; ``--check`` fails on a stale one).

- config_reference: docs/reference/configuration.md, from the configuration classes (as ``--print-config``)
- event_reference: docs/reference/events.md, from the events the code emits (read from its source)
- measurements: the performance page's tables, from docs/measurements/*.json
- troubleshooting: the troubleshooting page's advice on every error event, from troubleshooting.toml here
- pages: which pages and regions are generated; writing and checking them
- field_docs, markdown: the classes' comments as text; the Markdown it is written in

The site itself is mkdocs.yml and docs/ (``mkdocs build --strict``; tests/docs builds it).
"""
