"""What every layer shares: the failure convention (`common.errors`) and safe file writes (`common.files`)."""
