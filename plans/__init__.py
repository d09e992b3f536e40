"""What customers bought (price books, plans, subscriptions) and quota enforcement."""
