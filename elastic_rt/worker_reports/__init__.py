"""Worker -> agent reporting, both sides: step heartbeats and checkpoint commits.

Kept import-light: a training script imports it for report_step() without pulling in
prometheus_client, psutil or torch.
"""
