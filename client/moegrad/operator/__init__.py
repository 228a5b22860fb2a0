"""The operator: one call checked as aclnnMoeInitRoutingV2Grad's phase one checks it, per device profile."""
