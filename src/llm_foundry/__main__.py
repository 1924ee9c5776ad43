from llm_foundry.cli import main

if __name__ == "__main__":
    main()
