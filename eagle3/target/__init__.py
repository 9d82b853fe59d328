"""The target: where it comes from (``source``, ``wheels``), how it loads and runs with its aux-state
capture (``model``), the NVFP4 format (``nvfp4``) and chat templates (``chat``)."""
