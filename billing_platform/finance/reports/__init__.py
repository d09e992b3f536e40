"""Finance's reports across organizations, as rows: the one place the API, CSV and console read.

Each report is one function taking a frozen filter dataclass and returning a frozen report
dataclass; the signatures below are stable (the console's /finance/ pages and the REST API call
them as they are). Queries live with the tables' owners (``invoicing.reports``,
``metering.selectors``, ``plans.selectors``); this module composes and rounds. Money is
``Decimal`` in the row's currency, rounded to its minor unit; no report ever adds amounts of
two currencies (every total is per currency). Instants are aware UTC datetimes; ranges are
``[start, end)``.

- ``revenue_report(*, report_filter: RevenueFilter) -> RevenueReport``: ``rows`` per period
  (``unit``: month, quarter or year of the billing period's start) x currency x plan kind x
  line kind x model x region x service tier x token class, each with ``billed`` and
  ``accrued``; ``totals`` per period x currency and ``currency_totals`` per currency.
  *Billed* is what finalized invoices and credit notes say (``open``, ``paid`` and
  ``uncollectible`` ones; credit notes, kind ``credit_note``, are negative and carry the period
  they correct; ``void`` invoices are excluded, drafts are not documents yet): per period and
  currency it equals the sum of those documents' totals to the cent, tax and credits applied
  included (their own line kinds ``tax`` and ``credit``). *Accrued* is rated usage no invoice
  billed yet (each organization's open period on, plus late usage of closed periods the next
  invoice will bill), in the period of the open period's start; its exact sum is the sum of
  those events' rated amounts, and each row and total is rounded once from it.
  Plan kind (``plans.choices.RatingKind``): ``on_demand``, ``token_plan`` (plan usage,
  overage, plan fees, credit packs) or ``provisioned`` (reserved units, their spillover,
  reservation fees); "" for tax, credits applied, adjustments and credit notes.
- ``receivables_report(*, report_filter: ReceivablesFilter, limit: int = 100,
  offset: int = 0) -> ReceivablesReport``: unpaid finalized invoices (``rows``, one page,
  most days past due first; ``count`` all that match) with their aging bucket and dunning
  stage, and ``summaries`` per currency: open, overdue, the aging buckets, uncollectible,
  written off, and DSO.
- ``credits_report(*, report_filter: CreditsFilter) -> CreditsReport``: credit grants rolled
  forward over the range per currency x kind x expiry month: opening, granted, consumed,
  expired unused (breakage) and closing (the liability); ``totals`` per currency.
- ``customers_report(*, report_filter: CustomersFilter) -> CustomersReport``: top customers by
  billed revenue in the range (per currency) with the month-over-month change of the range's
  last month, ``months``: customers, new and churned per month x currency, and
  ``movements``: who is new or churned in which month.

``csv_rows(rows, RowType)`` yields a table (header first) for ``csv_export``; the columns are
``RowType.csv_columns()`` (the row dataclass's fields, in order), so the CSV equals the table.

One module per report (``revenue``, ``receivables``, ``credits``, ``customers``, ``margin``
(revenue against cost-to-serve, its own docstring says what counts), and ``rows`` for what
they share); import from the package, whose names below are the stable ones.
"""

from billing_platform.finance.reports.credits import (
    CreditRow,
    CreditsFilter,
    CreditsReport,
    credits_report,
)
from billing_platform.finance.reports.customers import (
    CustomerMonthRow,
    CustomerMovementRow,
    CustomersFilter,
    CustomersReport,
    TopCustomerRow,
    customers_report,
)
from billing_platform.finance.reports.margin import (
    COST_CURRENCY,
    MARGIN_BY,
    MarginFilter,
    MarginReport,
    MarginRow,
    PoolEconomicsRow,
    RequestMarginRow,
    margin_report,
)
from billing_platform.finance.reports.receivables import (
    AGING_BUCKETS,
    DSO_DAYS,
    DUNNING_STAGES,
    ReceivableRow,
    ReceivablesFilter,
    ReceivablesReport,
    ReceivablesSummary,
    receivables_report,
)
from billing_platform.finance.reports.revenue import (
    LINE_KINDS,
    PLAN_KINDS,
    UNITS,
    RevenueFilter,
    RevenueReport,
    RevenueRow,
    RevenueTotal,
    revenue_report,
)
from billing_platform.finance.reports.rows import Row, csv_rows

__all__ = [
    "AGING_BUCKETS", "COST_CURRENCY", "DSO_DAYS", "DUNNING_STAGES", "LINE_KINDS", "MARGIN_BY",
    "PLAN_KINDS", "UNITS", "CreditRow", "CreditsFilter", "CreditsReport", "CustomerMonthRow",
    "CustomerMovementRow", "CustomersFilter", "CustomersReport", "MarginFilter", "MarginReport",
    "MarginRow", "PoolEconomicsRow", "ReceivableRow", "ReceivablesFilter", "ReceivablesReport",
    "ReceivablesSummary", "RequestMarginRow", "RevenueFilter", "RevenueReport", "RevenueRow",
    "RevenueTotal", "Row", "TopCustomerRow", "credits_report", "csv_rows", "customers_report",
    "margin_report", "receivables_report", "revenue_report",
]
