"""``open-diloco report``: one self-contained HTML page that tells what a galaxy's run did, from the clusters'
jsonl metrics (docs/configuration.md, section Metrics).

- :mod:`~open_diloco.report.runs` reads the files and refuses what is not one whole run;
- :mod:`~open_diloco.report.story` judges the rounds: who was in each, splits and heals, the summary;
- :mod:`~open_diloco.report.svg` draws charts as inline SVG (no JS library, no network);
- :mod:`~open_diloco.report.page` puts them on the page.

Neither torch nor hivemind is imported here: a report runs on a laptop with the metrics copied from the sites.
"""
