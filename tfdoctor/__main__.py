from tfdoctor.cli import main

main()
