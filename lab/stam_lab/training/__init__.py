"""Fine-tuning the write modules with LoRA adapters (the paper's appendix "Write-Module Fine-Tuning")."""
