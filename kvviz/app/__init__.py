"""The Streamlit app's building blocks: URL-backed parameters, the sidebar, cards, cached compute and the
page sections. The only package that imports Streamlit (with app.py and pages/).

May import: every other layer of kvviz; nothing imports it but app.py and pages/.

Modules, lowest first; each imports only modules listed above it:
  labels, params        what the controls are called; their URL names, defaults and ranges (kvviz.links)
  guard                 the work budget's notices, cancellation on rerun, a fair pool of slots for heavy work
  store                 the URL-backed settings store and the w_* widgets that read and write it
  compute               Source (a trace with a cache identity); the core's calls through st.cache_*;
                        the background warm-up of the kernel
  cards, notes          metric cards and number formats; notes and warnings beside them
  compression, presets  the Compression section and the Spec it describes; one-click presets
  sources               the Real model and Trace file pickers, the shared model and its warm-up
  sidebar               Source, Compression and View in order: sidebar() -> Settings
  layout                every page's head (styles, Presentation mode, title), the page registry and
                        the folded expander (computes nothing while closed)
  overview, explorer, formats, ledger, lesson   the Explorer's sections (lesson: export the view as a page)
  modellab              the Model lab's parts: a live run, the runs this server keeps, the estimate, a result
  router                the pages (pages/) and st.navigation: app.py's body and every page's last line
  serve                 the server's start: app.py's st.App start-up hook and `python -m kvviz.app.serve`
"""
