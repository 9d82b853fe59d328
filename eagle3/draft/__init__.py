"""The draft: its layers and KV caches (``model``, ``rope``), the families behind one interface
(``families``), its vocabulary (``vocab``), the training-time test (``ttt``) with its targets
(``target_head``), objectives (``losses``) and metrics, and the engines' folder formats (``formats``)."""
