"""The read-only web page over the topics (``rollwire ui``): runs, sessions, calls, branches and traces.

``view`` (the bounded view), ``reader`` (the topics into it), ``pages`` (what each page shows), ``tokens``
(ids to text), ``app`` (routes and templates), ``links`` (URLs for the terminal), ``cli`` (the command).
Server-rendered with Jinja2, plus one hand-written script (``static/ui.js``) for live reloads and the
windowed trace view: no npm bundle, no CDN.
"""
