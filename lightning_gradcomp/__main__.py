from lightning_gradcomp.tools.cli import main

main()
