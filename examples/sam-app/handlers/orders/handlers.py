"""Two handlers of the orders team: one prices an order, one refunds a payment.

rdq's worker imports this module (``HandlerModules: orders.handlers``) from the layer the
application's template builds out of ``handlers/``; ``rdq_core`` itself comes with rdq.

```
orders.quote   {"order": "A-17", "currency": "EUR",
                "lines": [{"sku": "tea", "quantity": 2, "unit_cents": 450}]}
               -> {"order": "A-17", "currency": "EUR", "items": 2, "total_cents": 900}
orders.refund  {"order": "A-17", "charged_cents": 900, "refund_cents": 1200}
               -> dead at once: more than was charged can never be refunded
```
"""

from __future__ import annotations

from typing import Any

from rdq_core import PermanentError, TaskContext, handler


def _count(value: Any, what: str) -> int:
    # bool is an int to Python, never a quantity or an amount here.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PermanentError(f"{what} must be a whole number of at least 0, not {value!r}")
    return value


def _order(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get("order"), str) or not payload["order"]:
        raise PermanentError("the payload must be an object naming its order (\"order\": \"A-17\")")
    return payload


@handler("orders.quote", timeout_seconds=10)
def quote(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    """The order's total. A malformed order fails permanently: retrying cannot fix it."""
    order = _order(payload)
    lines = order.get("lines")
    if not isinstance(lines, list) or not lines:
        raise PermanentError(f"order {order['order']} has no lines to price")
    items = total = 0
    for number, line in enumerate(lines, 1):
        if not isinstance(line, dict):
            raise PermanentError(f"line {number} of order {order['order']} is not an object")
        quantity = _count(line.get("quantity"), f"line {number}'s quantity")
        items += quantity
        total += quantity * _count(line.get("unit_cents"), f"line {number}'s unit_cents")
    return {"order": order["order"], "currency": str(order.get("currency", "EUR")), "items": items,
            "total_cents": total}


@handler("orders.refund", timeout_seconds=10)
def refund(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    """Refunds at most what was charged; asking for more is refused for good (dead-lettered)."""
    order = _order(payload)
    charged = _count(order.get("charged_cents"), "charged_cents")
    amount = _count(order.get("refund_cents"), "refund_cents")
    if amount > charged:
        raise PermanentError(f"order {order['order']}: cannot refund {amount} cents of a {charged} cent charge")
    return {"order": order["order"], "refunded_cents": amount}
