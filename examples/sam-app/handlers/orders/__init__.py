"""The orders team's rdq handlers, shipped to rdq's worker as a Lambda layer (``python/orders``)."""
