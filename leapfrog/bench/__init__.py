"""`leapfrog bench`: suites that measure leapfrog against peers and its decoding methods against
`ar`, each as ratios within one run (cli.py dispatches)."""
